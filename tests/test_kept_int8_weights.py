"""int8 weights kept between loads (``accelgen.loading.kept_int8_weights``), through the command line: a second int8
load reads what the first kept and gives the same tokens; a damaged entry is said in one line and replaced; the cache
stays within its bound, drops a changed checkpoint's entry, and costs a run nothing where it cannot be written."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import PROMPTS, one_error_line
from family_models import family_config
from tiny_models import build_model, build_tokenizer

from accelgen.cli import main

KEPT, READ = "(int8 weights kept for the next load)", "(int8 weights kept by an earlier load)"


def run_int8(folder: Path, output: Path, capsys, dtype: str = "float32") -> tuple[list, str]:
    """(each prompt's completion token ids, the run's stderr) of an int8 run over the test prompts."""
    arguments = ["run", "--device", "cpu", "--model", str(folder), "--dtype", dtype, "--quantize", "int8",
                 "--max-new-tokens", "6", "--output", str(output), "--overwrite", "--quiet"]
    assert main([*arguments, *(argument for prompt in PROMPTS for argument in ("--prompt", prompt))]) == 0
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    return [row["completion_token_ids"] for row in rows], capsys.readouterr().err


def entries(cache: Path) -> list[Path]:
    return sorted(folder for folder in cache.iterdir() if (folder / "accelgen-shards.json").is_file())


@pytest.mark.parametrize("architecture,dtype", [("llama", "float32"), ("bloom", "bfloat16")])
def test_a_second_int8_load_reads_what_the_first_kept_and_gives_the_same_tokens(tiny_model_folder, tmp_path, capsys,
                                                                                 monkeypatch, architecture, dtype):
    folder = tiny_model_folder(architecture)
    unkept, err = run_int8(folder, tmp_path / "off.jsonl", capsys, dtype)  # the suite's default: no cache
    assert KEPT not in err and READ not in err
    monkeypatch.setenv("ACCELGEN_WEIGHTS_CACHE", str(tmp_path / "cache"))
    first, err = run_int8(folder, tmp_path / "first.jsonl", capsys, dtype)
    assert KEPT in err
    [entry] = entries(tmp_path / "cache")
    manifest = json.loads((entry / "accelgen-shards.json").read_text())
    assert (manifest["world_size"], manifest["dtype"], manifest["quantize"]) == (1, dtype, "int8")
    assert manifest["source"]["location"] == str(folder)
    for run in ("second", "third"):
        again, err = run_int8(folder, tmp_path / f"{run}.jsonl", capsys, dtype)
        assert READ in err and KEPT not in err
        assert again == first == unkept
    assert entries(tmp_path / "cache") == [entry]


def wide_llama(folder: Path, seed: int = 0, hidden_size: int = 256) -> Path:
    """A Llama of several MiB (the tiny ones are smaller than the bytes a checkpoint's identity reads), with the test
    tokenizer."""
    tokenizer = build_tokenizer(folder.parent / "tokenizer")
    build_model(folder, family_config("llama", len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size),
                seed)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_second_load_reads_no_full_precision_weight(tmp_path, capsys, monkeypatch):
    """The checkpoint's weights are not read again: a weight file changed everywhere but in the first and last MiB
    that its identity reads (a change no user makes, and that gives other tokens when read) still gives the kept
    model's tokens."""
    folder = wide_llama(tmp_path / "model")
    monkeypatch.setenv("ACCELGEN_WEIGHTS_CACHE", str(tmp_path / "cache"))
    first, _ = run_int8(folder, tmp_path / "first.jsonl", capsys)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    assert len(data) > 3 << 20
    data[1 << 20 : len(data) - (1 << 20)] = bytes(len(data) - (2 << 20))  # zeros: finite, and far from the weights
    weights.write_bytes(bytes(data))
    again, err = run_int8(folder, tmp_path / "again.jsonl", capsys)
    assert READ in err and again == first
    monkeypatch.setenv("ACCELGEN_WEIGHTS_CACHE", "off")
    read, _ = run_int8(folder, tmp_path / "read.jsonl", capsys)
    assert read != first  # the change is one the tokens show


@pytest.mark.parametrize("damage,problem", [
    ("cut", "bytes"),  # a rank file cut short
    ("manifest", "accelgen-shards.json"),
    ("other_key", "names another model"),
])
def test_a_damaged_entry_is_said_in_one_line_and_kept_again(tiny_model_folder, tmp_path, capsys, monkeypatch, damage,
                                                           problem):
    folder = tiny_model_folder("llama")
    monkeypatch.setenv("ACCELGEN_WEIGHTS_CACHE", str(tmp_path / "cache"))
    first, _ = run_int8(folder, tmp_path / "first.jsonl", capsys)
    [entry] = entries(tmp_path / "cache")
    manifest_path = entry / "accelgen-shards.json"
    if damage == "cut":
        rank_file = entry / "rank-00000-of-00001-part-00000.safetensors"
        os.truncate(rank_file, rank_file.stat().st_size - 100)
    elif damage == "manifest":
        manifest_path.write_text("{not json")
    else:
        manifest = json.loads(manifest_path.read_text())
        manifest["source"]["key"] = "0" * 32
        manifest_path.write_text(json.dumps(manifest))
    again, err = run_int8(folder, tmp_path / "again.jsonl", capsys)
    warned = [line for line in err.splitlines() if "were damaged" in line]
    assert len(warned) == 1 and warned[0].startswith("accelgen: warning: ") and problem in warned[0]
    assert KEPT in err and again == first
    third, err = run_int8(folder, tmp_path / "third.jsonl", capsys)
    assert READ in err and "were damaged" not in err and third == first


def entry_bytes(entry: Path) -> int:
    return sum(path.stat().st_size for path in entry.iterdir())


def test_the_cache_keeps_to_its_bound_and_drops_what_is_used_least_or_stale(tiny_model_folder, tmp_path, capsys,
                                                                          monkeypatch):
    cache, scratch = tmp_path / "cache", tmp_path / "scratch"
    llama, opt, big = tiny_model_folder("llama"), tiny_model_folder("opt"), wide_llama(tmp_path / "big", hidden_size=96)
    monkeypatch.setenv("ACCELGEN_WEIGHTS_CACHE", str(scratch))  # what big's entry takes
    run_int8(big, tmp_path / "out.jsonl", capsys)
    big_bytes = entry_bytes(entries(scratch)[0])
    monkeypatch.setenv("ACCELGEN_WEIGHTS_CACHE", str(cache))
    monkeypatch.setenv("ACCELGEN_WEIGHTS_CACHE_GB", "0.000001")  # smaller than any model: nothing kept
    _, err = run_int8(llama, tmp_path / "out.jsonl", capsys)
    assert KEPT not in err and not entries(cache)
    monkeypatch.delenv("ACCELGEN_WEIGHTS_CACHE_GB")
    run_int8(llama, tmp_path / "out.jsonl", capsys)
    run_int8(opt, tmp_path / "out.jsonl", capsys)
    llama_entry, opt_entry = entries(cache)  # both kept
    if json.loads((llama_entry / "accelgen-shards.json").read_text())["source"]["location"] != str(llama):
        llama_entry, opt_entry = opt_entry, llama_entry
    # room for opt's entry and big's, not for llama's beside them
    bound = entry_bytes(opt_entry) + big_bytes + entry_bytes(llama_entry) // 2
    monkeypatch.setenv("ACCELGEN_WEIGHTS_CACHE_GB", str(bound / 1e9))
    _, err = run_int8(big, tmp_path / "out.jsonl", capsys)
    assert KEPT not in err  # every entry was used in the last hour (a run may be reading it): none removed for room
    long_ago = time.time() - 2 * 3600
    os.utime(llama_entry / "accelgen-shards.json", (long_ago, long_ago))
    os.utime(opt_entry / "accelgen-shards.json", (long_ago + 60, long_ago + 60))
    _, err = run_int8(big, tmp_path / "out.jsonl", capsys)
    kept = entries(cache)
    assert KEPT in err and llama_entry not in kept and opt_entry in kept and len(kept) == 2  # the one used longest ago
    assert sum(entry_bytes(entry) for entry in kept) <= bound
    # the same place, other weights: the old weights' entry goes, though used a moment ago
    [old_big] = [entry for entry in kept if entry != opt_entry]
    wide_llama(big, seed=1, hidden_size=96)
    _, err = run_int8(big, tmp_path / "out.jsonl", capsys)
    assert KEPT in err and old_big not in entries(cache) and len(entries(cache)) == 2


def test_a_cache_that_cannot_be_written_costs_the_run_a_line(tiny_model_folder, tmp_path, capsys, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("ACCELGEN_WEIGHTS_CACHE", str(blocked))
    tokens, err = run_int8(tiny_model_folder("llama"), tmp_path / "out.jsonl", capsys)
    warned = [line for line in err.splitlines() if "could not be kept" in line]
    assert len(warned) == 1 and "ACCELGEN_WEIGHTS_CACHE" in warned[0] and tokens


def test_the_cache_is_in_the_users_cache_folder_unless_told_otherwise(tiny_model_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ACCELGEN_WEIGHTS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    run_int8(tiny_model_folder("llama"), tmp_path / "out.jsonl", capsys)
    assert len(entries(tmp_path / "xdg" / "accelgen" / "int8-weights")) == 1


def test_a_bound_that_is_not_a_number_is_one_line(tiny_model_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ACCELGEN_WEIGHTS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ACCELGEN_WEIGHTS_CACHE_GB", "lots")
    arguments = ["run", "--model", str(tiny_model_folder("llama")), "--quantize", "int8", "--prompt", "hi"]
    assert main(arguments) == 2
    assert "ACCELGEN_WEIGHTS_CACHE_GB='lots' is not a number of gigabytes" in one_error_line(capsys)
