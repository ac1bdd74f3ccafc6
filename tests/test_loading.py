"""Models of any size: each rank reads only its part of the checkpoint, or only its own files of a folder
that `accelgen shard` wrote. Real processes: `accelgen shard` and `accelgen run --world-size 2` over gloo."""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_to_the_end, with_fault_drill
from test_parity import MAX_NEW_TOKENS, reference_completions
from tiny_models import build_model
from transformers import AutoModelForCausalLM, BloomConfig, LlamaConfig

import accelgen
from accelgen.cli import main
from accelgen.common.errors import AccelgenWarning
from accelgen.loading.pre_sharded import MANIFEST

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.slow

PROMPTS = ["DeepSpeed is a machine learning framework", "Hello", "The quick brown fox jumps"]


def accelgen_script(environment, *arguments, timeout=300):
    return run_to_the_end([sys.executable, "-m", "accelgen.cli", *arguments], environment, timeout)


def prompt_arguments():
    return [argument for prompt in PROMPTS for argument in ("--prompt", prompt)]


def completion_ids(path):
    return [json.loads(line)["completion_token_ids"] for line in Path(path).read_text().splitlines()]


def shard(environment, model, output, world_size=2, *extra):
    return accelgen_script(environment, "shard", "--device", "cpu", "--model", str(model), "--world-size", str(world_size),
                           "--dtype", "float32", "--output", str(output), *extra)


@pytest.fixture(scope="module")
def sharded_for_two(tiny_model_folder, tmp_path_factory):
    """``sharded_for_two(architecture)``: the tiny model of that family, sharded for two ranks."""
    root = tmp_path_factory.mktemp("sharded")
    environment = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    made = {}

    def folder_for(architecture):
        if architecture not in made:
            result = shard(environment, tiny_model_folder(architecture), root / architecture)
            assert result.returncode == 0, result.stderr
            made[architecture] = root / architecture
        return made[architecture]

    return folder_for


@pytest.mark.transformers_release
@pytest.mark.parametrize("architecture", ["bloom", "llama", "opt"])
def test_a_pre_sharded_model_generates_what_hugging_face_generates(sharded_for_two, tiny_model_folder, tmp_path,
                                                                   cli_environment, architecture):
    folder = sharded_for_two(architecture)
    names = sorted(path.name for path in folder.iterdir())
    assert MANIFEST in names and "config.json" in names and "tokenizer.json" in names
    assert [name for name in names if name.endswith(".safetensors")] == [
        "rank-00000-of-00002-part-00000.safetensors", "rank-00001-of-00002-part-00000.safetensors"]
    assert not Path(f"{folder}.partial").exists()
    manifest = json.loads((folder / MANIFEST).read_text())
    assert (manifest["world_size"], manifest["dtype"], manifest["format_version"]) == (2, "float32", 1)

    output = tmp_path / "out.jsonl"
    result = accelgen_script(cli_environment, "run", "--device", "cpu", "--world-size", "2", "--model", str(folder),
                             *prompt_arguments(), "--batch-size", "2", "--max-new-tokens", str(MAX_NEW_TOKENS),
                             "--output", str(output), "--details")
    assert result.returncode == 0, result.stderr
    original = str(tiny_model_folder(architecture))
    expected = [completion.completion_token_ids for completion in
                accelgen.generate(PROMPTS, model=original, device="cpu", max_new_tokens=MAX_NEW_TOKENS)]
    assert completion_ids(output) == expected
    assert expected == reference_completions(original, PROMPTS)
    assert "parameter bytes per rank" in result.stderr and "(0.5" in result.stderr


def test_a_model_sharded_for_one_rank_runs_alone_in_another_dtype(tiny_model_folder, tmp_path, cli_environment):
    folder = tmp_path / "bloom-1"
    result = accelgen_script(cli_environment, "shard", "--device", "cpu", "--model", str(tiny_model_folder("bloom")),
                             "--world-size", "1", "--dtype", "bfloat16", "--output", str(folder))
    assert result.returncode == 0, result.stderr
    options = dict(device="cpu", max_new_tokens=MAX_NEW_TOKENS, dtype="bfloat16")
    assert [c.completion_token_ids for c in accelgen.generate(PROMPTS, model=str(folder), **options)] == [
        c.completion_token_ids for c in accelgen.generate(PROMPTS, model=str(tiny_model_folder("bloom")), **options)]


def test_files_are_written_a_part_at_a_time(tiny_model_folder, tmp_path, cli_environment):
    """--max-file-mib bounds each file (and what a rank holds while writing): many parts, same model."""
    model = build_model(tmp_path / "llama-5mb", LlamaConfig(
        num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4, vocab_size=384))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_folder("llama") / name, model / name)
    folder = tmp_path / "llama-parts"
    result = shard(cli_environment, model, folder, 1, "--max-file-mib", "1")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((folder / MANIFEST).read_text())
    [files] = manifest["rank_files"]
    assert len(files) > 1
    options = dict(device="cpu", max_new_tokens=MAX_NEW_TOKENS)
    assert [c.completion_token_ids for c in accelgen.generate(PROMPTS, model=str(folder), **options)] == [
        c.completion_token_ids for c in accelgen.generate(PROMPTS, model=str(model), **options)]


def host_bytes_added_while_loading(stderr: str) -> list[int]:
    added = re.search(r"host bytes added while loading per rank ([\d,]+) / ([\d,]+)", stderr)
    return [int(group.replace(",", "")) for group in added.groups()]


def test_no_rank_holds_the_whole_model_while_loading(tiny_model_folder, tmp_path, cli_environment):
    """Each rank's peak host memory while loading a 300 MB model over two ranks, less what loading the tiny
    model costs a rank (DeepSpeed's own memory), stays near its half: far below the whole model."""
    big = tmp_path / "bloom-300mb"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(BloomConfig(n_layer=6, hidden_size=1024, n_head=16, vocab_size=384))
    model.save_pretrained(big)
    model_bytes = sum(parameter.numel() * 4 for parameter in model.parameters())
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_folder("bloom") / name, big / name)

    def added(folder):
        result = accelgen_script(cli_environment, "run", "--device", "cpu", "--world-size", "2", "--model", str(folder),
                                 "--prompt", "Hello", "--max-new-tokens", "2", "--details")
        assert result.returncode == 0, result.stderr
        return host_bytes_added_while_loading(result.stderr)

    fixed_costs = added(tiny_model_folder("bloom"))
    for rank, (big_model, tiny_model) in enumerate(zip(added(big), fixed_costs)):
        assert big_model - tiny_model < 0.6 * model_bytes, f"rank {rank} held {(big_model - tiny_model) / model_bytes:.2f}x"


def test_a_pickle_checkpoint_still_loads_with_a_line_saying_safetensors_is_faster(tiny_model_folder, tmp_path, capsys):
    folder = tmp_path / "pickled"
    shutil.copytree(tiny_model_folder("opt"), folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    options = dict(device="cpu", max_new_tokens=MAX_NEW_TOKENS)
    with pytest.warns(AccelgenWarning, match=r"pickle \(\.bin\) weights"):  # the library warns
        completions = accelgen.generate(PROMPTS, model=str(folder), **options)
    assert [c.completion_token_ids for c in completions] == reference_completions(str(tiny_model_folder("opt")), PROMPTS)
    # the command line shows the warning as one line
    assert main(["run", "--device", "cpu", "--model", str(folder), "--prompt", "Hello", "--max-new-tokens", "2"]) == 0
    [line] = [line for line in capsys.readouterr().err.splitlines() if "pickle" in line]
    assert line.startswith("accelgen: warning: ") and "safetensors load faster" in line


def run_exit(capsys, *arguments):
    capsys.readouterr()  # what fixtures printed
    status = main(list(arguments))
    return status, capsys.readouterr().err


def test_a_folder_sharded_for_another_world_size_or_dtype_is_one_line(sharded_for_two, capsys):
    folder = str(sharded_for_two("bloom"))
    status, error = run_exit(capsys, "run", "--device", "cpu", "--model", folder, "--prompt", "a")
    assert status == 2
    assert error == (f"accelgen: error: {folder!r} is sharded for --world-size 2 --dtype float32, not --world-size 1: run it "
                     f"with --world-size 2, or shard the original model for 1 rank(s).\n")
    status, error = run_exit(capsys, "run", "--device", "cpu", "--model", folder, "--prompt", "a", "--world-size", "2",
                             "--dtype", "bfloat16")
    assert status == 2 and "not --dtype bfloat16: run it with --dtype float32" in error


@pytest.mark.parametrize("damage, message", [
    (lambda folder: (folder / "rank-00001-of-00002-part-00000.safetensors").unlink(),
     "rank-00001-of-00002-part-00000.safetensors: rank 1's file, named by accelgen-shards.json, is missing"),
    (lambda folder: os.truncate(folder / "rank-00000-of-00002-part-00000.safetensors",
                                (folder / "rank-00000-of-00002-part-00000.safetensors").stat().st_size - 100),
     "rank-00000-of-00002-part-00000.safetensors: truncated"),
    (lambda folder: (folder / MANIFEST).write_text(json.dumps(
        {**json.loads((folder / MANIFEST).read_text()), "format_version": 2, "accelgen_version": "9.0"})),
     "was sharded by a newer accelgen (9.0, format 2; this one reads format 1): upgrade accelgen"),
])
def test_a_damaged_pre_sharded_folder_is_one_line_before_any_rank_starts(sharded_for_two, tmp_path, capsys, damage, message):
    folder = tmp_path / "copy"
    shutil.copytree(sharded_for_two("bloom"), folder)
    damage(folder)
    status, error = run_exit(capsys, "run", "--device", "cpu", "--model", str(folder), "--prompt", "a", "--world-size", "2")
    assert status == 2
    assert message in error and error.count("\n") == 1


def test_shard_refuses_an_existing_output_unless_told_to_overwrite(tiny_model_folder, tmp_path, capsys, cli_environment):
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("mine")
    status, error = run_exit(capsys, "shard", "--device", "cpu", "--model", str(tiny_model_folder("opt")), "--world-size",
                             "1", "--dtype", "float32", "--output", str(output))
    assert status == 2
    assert error == f"accelgen: error: --output {str(output)!r} exists: pass --overwrite to replace it, or another --output.\n"
    assert (output / "keep.txt").read_text() == "mine"
    # --overwrite replaces only a folder accelgen shard wrote (or an empty one): never the user's files
    status, error = run_exit(capsys, "shard", "--device", "cpu", "--model", str(tiny_model_folder("opt")), "--world-size",
                             "1", "--dtype", "float32", "--output", str(output), "--overwrite")
    assert status == 2 and "is a folder accelgen shard did not write" in error
    assert (output / "keep.txt").read_text() == "mine"
    (output / "keep.txt").unlink()
    status, _ = run_exit(capsys, "shard", "--device", "cpu", "--model", str(tiny_model_folder("opt")), "--world-size",
                         "1", "--dtype", "float32", "--output", str(output), "--overwrite")
    assert status == 0
    assert (output / MANIFEST).is_file()


def test_a_shard_job_stopped_half_way_leaves_nothing_that_passes_for_complete(tiny_model_folder, tmp_path, cli_environment,
                                                                             capsys):
    output = tmp_path / "llama-tp2"
    partial = Path(f"{output}.partial")
    failing = with_fault_drill(cli_environment, hook="shard")  # rank 1 fails once DeepSpeed has split the model
    result = shard(failing, tiny_model_folder("llama"), output)
    assert result.returncode != 0
    assert "injected fault on rank 1" in result.stderr
    assert not output.exists() and not partial.exists()  # removed by the launcher once its ranks had ended
    # ranks that end half-way with no launcher of ours to clean up (torchrun started by hand; a launcher killed
    # outright) leave the staging folder behind
    result = run_to_the_end([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "-m", "accelgen.cli", "shard", "--device", "cpu", "--model", str(tiny_model_folder("llama")),
                              "--world-size", "2", "--dtype", "float32", "--output", str(output)], failing, timeout=300)
    assert result.returncode != 0 and "injected fault on rank 1" in result.stderr
    assert not output.exists() and partial.is_dir()
    assert not (partial / MANIFEST).exists() and not (partial / "config.json").exists()
    status, error = run_exit(capsys, "run", "--device", "cpu", "--model", str(partial), "--prompt", "a")
    assert status == 2 and "has no config.json" in error

    result = shard(cli_environment, tiny_model_folder("llama"), output)  # the next job starts afresh
    assert result.returncode == 0, result.stderr
    assert (output / MANIFEST).is_file() and not partial.exists()


@pytest.mark.parametrize("arguments, message", [
    (["--world-size", "2", "--dtype", "float32"], "accelgen shard does not know how DeepSpeed splits gpt2 models yet"),
    (["--dtype", "float32"], "accelgen shard needs --world-size N"),
])
def test_bad_shard_requests_are_one_line(tiny_model_folder, tmp_path, capsys, arguments, message):
    status, error = run_exit(capsys, "shard", "--device", "cpu", "--model", str(tiny_model_folder("gpt2")),
                             "--output", str(tmp_path / "o"), *arguments)
    assert status == 2 and message in error and error.count("\n") == 1


@pytest.mark.transformers_release
def test_a_hub_model_is_read_from_the_cache_by_every_rank(tiny_model_folder, tmp_path, cli_environment):
    """A Hub id, offline, with the model in the Hugging Face cache (as a first download leaves it)."""
    cache = tmp_path / "hub"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--accelgen-test--tiny-llama" / "snapshots" / revision
    shutil.copytree(tiny_model_folder("llama"), snapshot)
    (cache / "models--accelgen-test--tiny-llama" / "refs").mkdir()
    (cache / "models--accelgen-test--tiny-llama" / "refs" / "main").write_text(revision)
    environment = dict(cli_environment, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    output = tmp_path / "out.jsonl"
    result = accelgen_script(environment, "run", "--device", "cpu", "--world-size", "2", "--model",
                             "accelgen-test/tiny-llama", *prompt_arguments(), "--max-new-tokens", str(MAX_NEW_TOKENS),
                             "--output", str(output))
    assert result.returncode == 0, result.stderr
    assert completion_ids(output) == reference_completions(str(tiny_model_folder("llama")), PROMPTS)
