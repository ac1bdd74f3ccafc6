"""Broken files and odd values, as users meet them: each is one ``accelgen: error:`` line on stderr, exit
status 2, no traceback, and nothing the user already had is changed (byte for byte).

Most cases run ``accelgen.cli.main`` in this process (the command line without the process start-up); the
ones that need a real process (bytes in argv, a file size limit standing in for a full disk, a launched
tensor-parallel job) run the ``accelgen`` module in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import one_error_line

import accelgen
from accelgen.cli import main
from accelgen.loading.model_files import DEFAULT_MODEL

ROWS = [{"text": text} for text in ("In the beginning", "And God said", "Let there be light", "And it was so")]
QUICK = ["--device", "cpu", "--max-new-tokens", "3", "--quiet"]


def run_fails(capsys, *arguments: str) -> str:
    assert main(["run", *QUICK, *arguments]) == 2
    return one_error_line(capsys)


def write_lines(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def jsonl(rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


# -- checkpoints --------------------------------------------------------------------------------

@pytest.fixture
def model_copy(tmp_path):
    """A copy of the built-in model that a test may damage."""
    return Path(shutil.copytree(DEFAULT_MODEL, tmp_path / "model"))


def truncate_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def corrupt_header(path: Path) -> None:
    with open(path, "r+b") as file:
        file.write(b"\xff" * 8)


@pytest.mark.parametrize("damage, message", [
    (truncate_half, "model.safetensors: truncated: 1,320,780 bytes, the header describes 2,641,560"),
    (corrupt_header, "model.safetensors: corrupt header (it claims 18,446,744,073,709,551,615 bytes"),
    (lambda path: path.write_bytes(b"abc"), "model.safetensors: 3 bytes, too short to be a safetensors file"),
])
def test_a_damaged_weight_file_is_named_before_loading(model_copy, capsys, damage, message):
    damage(model_copy / "model.safetensors")
    error = run_fails(capsys, "--model", str(model_copy), "--prompt", "Hello")
    assert f"Model '{model_copy}' has a damaged weight file: {message}" in error
    assert error.rstrip().endswith("download or save the model again.")


def test_a_sharded_checkpoint_missing_a_shard_or_its_index_is_named(tiny_model_folder, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "sharded"
    source = tiny_model_folder("llama")
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(folder, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    assert main(["run", *QUICK, "--model", str(folder), "--prompt", "Hello"]) == 0  # whole, it loads
    capsys.readouterr()
    shards[1].unlink()
    error = run_fails(capsys, "--model", str(folder), "--prompt", "Hello")
    assert f"{shards[1].name}: named by model.safetensors.index.json but missing from the folder (1 shard(s) missing)" in error
    write_lines(folder / "model.safetensors.index.json", '{"weight_map": ')
    assert "model.safetensors.index.json: not a readable shard index" in run_fails(capsys, "--model", str(folder), "--prompt", "Hi")


def test_a_damaged_checkpoint_stops_a_tensor_parallel_job_before_any_rank_starts(model_copy, cli_environment):
    truncate_half(model_copy / "model.safetensors")
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", *QUICK, "--world-size", "2", "--model", str(model_copy),
         "--prompt", "Hello"], env=cli_environment, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr  # no rank started to print one
    assert "has a damaged weight file: model.safetensors: truncated" in result.stderr


# -- dataset rows -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, content, message", [
    ("torn.jsonl", jsonl(ROWS[:2]) + '{"tex',
     "Dataset '{path}' line 3 (row 2) is not valid JSON (a torn last line: the file is still being written, or was cut "
     "short) (Unterminated string starting at: line 1 column 2 (char 1)): fix or remove that line, or pass --skip-bad-rows "
     "to write such rows as error rows and go on."),
    ("garbage.jsonl", jsonl(ROWS[:1]) + "garbage\n" + jsonl(ROWS[1:]),
     "Dataset '{path}' line 2 (row 1) is not valid JSON (Expecting value: line 1 column 1 (char 0)): fix or remove that "
     "line, or pass --skip-bad-rows to write such rows as error rows and go on."),
    ("null.jsonl", jsonl(ROWS[:2] + [{"text": None}] + ROWS[2:]),
     "Dataset '{path}' row 2, column 'text', is null (no text): fill it in, or remove that row, or pass --skip-bad-rows "
     "to write such rows as error rows and go on (rows count from 0, as the output's \"index\")."),
    ("blank.jsonl", jsonl(ROWS[:1] + [{"text": "  "}]),
     "Dataset '{path}' row 1, column 'text', is empty: give it some text, or remove it"),
    ("ragged.csv", "text,n\na,1\nb,2,3\nc,4\n",
     "Error tokenizing data. C error: Expected 2 fields in line 3, saw 3: fix the file"),
    ("latin1.jsonl", jsonl(ROWS[:1]).encode() + '{"text": "café"}\n'.encode("latin-1"),
     "Dataset '{path}' line 2 (row 1) is not UTF-8 text (byte 0xe9 at byte 13): convert the file to UTF-8, e.g. with "
     "iconv -t UTF-8, or pass --skip-bad-rows to write such rows as error rows and go on."),
    ("empty.jsonl", "", "Dataset '{path}' (split 'train') has no rows to complete."),
    ("not.parquet", "", None),
])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_dataset_row_that_cannot_be_read_is_named_before_the_model_loads(tmp_path, capsys, name, content, message, streaming):
    if message is None:  # a file in a known format whose content is not: the reader's reason, quoted
        name, content, message = "bad.parquet", "not parquet", "Cannot read dataset '{path}': Parquet magic bytes not found"
    path = write_lines(tmp_path / name, content)
    error = run_fails(capsys, "--dataset", str(path), *(["--streaming"] if streaming else []))
    assert message.format(path=path) in error


def test_a_streamed_row_that_cannot_be_read_keeps_the_rows_before_it_and_resumes_once_fixed(tmp_path, capsys):
    dataset = write_lines(tmp_path / "rows.jsonl", jsonl(ROWS[:2] + [{"text": None}] + ROWS[3:]))
    output = tmp_path / "out.jsonl"
    error = run_fails(capsys, "--dataset", str(dataset), "--streaming", "--output", str(output))
    assert "row 2, column 'text', is null" in error
    assert [json.loads(line)["index"] for line in output.read_text().splitlines()] == [0, 1]
    write_lines(dataset, jsonl(ROWS))  # fixed
    assert main(["run", *QUICK, "--dataset", str(dataset), "--streaming", "--output", str(output)]) == 0
    assert "resuming: 2 rows already" in capsys.readouterr().err
    assert [json.loads(line)["prompt"] for line in output.read_text().splitlines()] == [row["text"] for row in ROWS]


# -- run records and outputs --------------------------------------------------------------------

@pytest.fixture
def finished_output(tmp_path):
    """(dataset, output) after a complete run: the output and its run record exist."""
    dataset = write_lines(tmp_path / "rows.jsonl", jsonl(ROWS))
    output = tmp_path / "out.jsonl"
    assert main(["run", *QUICK, "--dataset", str(dataset), "--output", str(output)]) == 0
    return dataset, output


def _run_record(output: Path) -> Path:
    return output.with_name(output.name + ".run.json")


def replace_run_record(text: str):
    def damage(output: Path) -> None:
        _run_record(output).write_text(text)
    return damage


def run_record_is_a_folder(output: Path) -> None:
    _run_record(output).unlink()
    _run_record(output).mkdir()


def corrupt_second_line(output: Path) -> None:
    lines = output.read_bytes().splitlines(keepends=True)
    output.write_bytes(lines[0] + lines[1][:20] + b"\x00\n" + b"".join(lines[2:]))


def drop_a_field(output: Path) -> None:
    lines = output.read_text().splitlines(keepends=True)
    first = json.loads(lines[0])
    del first["completion"]
    output.write_text(json.dumps(first) + "\n" + "".join(lines[1:]))


def index_as_text(output: Path) -> None:
    lines = output.read_text().splitlines(keepends=True)
    third = json.loads(lines[2])
    third["index"] = str(third["index"])
    output.write_text("".join(lines[:2]) + json.dumps(third) + "\n" + "".join(lines[3:]))


@pytest.mark.parametrize("damage, message", [
    (replace_run_record('{"model": '), "Run record '{record}' cannot be read: Expecting value: line 1 column 11 (char 10): "
                                       "it says which run wrote '{output}'; restore it, or pass --overwrite"),
    (replace_run_record(""), "Run record '{record}' cannot be read: Expecting value"),
    (replace_run_record("[1, 2]"), "Run record '{record}' holds list, not a run's description"),
    (run_record_is_a_folder, "Run record '{record}' (beside --output '{output}') is not a file: move it away."),
    (corrupt_second_line, "--output '{output}' line 2 is not a JSON line (Invalid control character"),
    (drop_a_field, "--output '{output}' line 1 is not a completion written by accelgen run (its fields: index, prompt, "
                   "completion, completion_token_ids, prompt_token_count, finish_reason): the file is damaged; pass "
                   "--overwrite to start it again."),
    (index_as_text, "--output '{output}' line 3 has index \"2\", not a whole row number (row 2 is expected there): the "
                    "file is damaged; keep its first 2 lines (head -n 2) to resume after them, or pass --overwrite"),
])
def test_a_damaged_output_or_run_record_is_refused_and_left_as_it_is(finished_output, capsys, damage, message):
    dataset, output = finished_output
    capsys.readouterr()
    damage(output)
    before = output.read_bytes()
    error = run_fails(capsys, "--dataset", str(dataset), "--output", str(output))
    assert message.format(output=output, record=_run_record(output)) in error
    assert output.read_bytes() == before


def test_the_damaged_line_tells_how_many_lines_to_keep(finished_output, capsys):
    dataset, output = finished_output
    corrupt_second_line(output)
    error = run_fails(capsys, "--dataset", str(dataset), "--output", str(output))
    assert "keep its first 1 lines (head -n 1) to resume after them, or pass --overwrite" in error


@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
@pytest.mark.parametrize("name_output", [
    lambda dataset: dataset,  # the very file
    lambda dataset: dataset.parent / "link.jsonl",  # a link to it
    lambda dataset: dataset.parent / "sub" / ".." / dataset.name,  # another spelling of it
])
def test_the_dataset_being_read_is_never_an_output(tmp_path, capsys, flags, name_output):
    dataset = write_lines(tmp_path / "rows.jsonl", jsonl(ROWS))
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.jsonl").symlink_to(dataset)
    before = dataset.read_bytes()
    output = name_output(dataset)
    error = run_fails(capsys, "--dataset", str(dataset), "--output", str(output), *flags)
    assert f"--output '{output}' would overwrite the dataset being read ('{dataset}')" in error
    assert dataset.read_bytes() == before


def test_an_output_inside_a_dataset_folder_is_refused(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    write_lines(folder / "rows.jsonl", jsonl(ROWS))
    error = run_fails(capsys, "--dataset", str(folder), "--output", str(folder / "out.jsonl"))
    assert "would overwrite the dataset being read" in error
    assert sorted(path.name for path in folder.iterdir()) == ["rows.jsonl"]


def test_an_output_that_is_not_a_regular_file_is_refused(tmp_path, capsys):
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    error = run_fails(capsys, "--prompt", "Hello", "--output", str(pipe))
    assert f"--output '{pipe}' is not a regular file (a device or a pipe): give a file name such as out.jsonl." in error
    assert run_fails(capsys, "--prompt", "Hello", "--output", os.devnull).startswith("accelgen: error: --output '/dev/null'")
    assert Path(os.devnull).is_char_device() and not Path(os.devnull + ".run.json").exists()


def _limit_file_size(limit: int):
    def apply() -> None:  # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG, as a full disk fails
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_a_full_disk_stops_the_run_with_every_finished_row_kept_and_resumable(tmp_path, cli_environment):
    prompts = [argument for row in ROWS * 3 for argument in ("--prompt", row["text"])]
    command = [sys.executable, "-m", "accelgen.cli", "run", *QUICK, *prompts]
    reference = tmp_path / "reference.jsonl"
    subprocess.run([*command, "--output", str(reference)], env=cli_environment, check=True, timeout=120)
    lines = reference.read_bytes().splitlines(keepends=True)
    # the limit is per file: the run record must fit; the completions then fill it after a few rows
    limit = _run_record(reference).stat().st_size + 10
    fitting = max(count for count in range(len(lines) + 1) if sum(map(len, lines[:count])) <= limit)
    assert 0 < fitting < len(lines)
    output = tmp_path / "out.jsonl"
    full = subprocess.run([*command, "--output", str(output)], env=cli_environment, capture_output=True, text=True,
                          timeout=120, preexec_fn=_limit_file_size(limit))
    assert full.returncode == 2
    assert full.stderr.count("\n") == 1 and "Traceback" not in full.stderr
    assert full.stderr.startswith(f"accelgen: error: Cannot write --output '{output}': File too large: {fitting} rows are "
                                  f"kept; make room (or move the file and its .run.json) and run the same command again")
    assert output.read_bytes().startswith(b"".join(lines[:fitting]))  # and a torn line after them, cut on resume
    resumed = subprocess.run([*command, "--output", str(output)], env=cli_environment, capture_output=True, text=True,
                             timeout=120)
    assert resumed.returncode == 0 and f"resuming: {fitting} rows already" in resumed.stderr
    assert output.read_bytes() == reference.read_bytes()


# -- numbers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("arguments, message", [
    (["--do-sample", "--temperature", "nan"], "argument --temperature: must be a number above 0, got 'nan'"),
    (["--do-sample", "--temperature", "inf"], "argument --temperature: must be a number above 0, got 'inf'"),
    (["--temperature", "0"], "argument --temperature: must be a number above 0, got '0'"),
    (["--do-sample", "--top-p", "nan"], "argument --top-p: must be a number above 0 and at most 1, got 'nan'"),
    (["--do-sample", "--top-k", "99999999999999999999"], "argument --top-k: must be a whole number from 0 to 2147483647"),
    (["--do-sample", "--seed", "1763830000123456789123"],
     "argument --seed: must be a whole number from 0 to 18446744073709551615, got '1763830000123456789123'"),
    (["--do-sample", "--seed", "-1"], "argument --seed: must be a whole number from 0 to 18446744073709551615"),
    (["--max-new-tokens", "1000000000000"], "argument --max-new-tokens: must be a whole number from 1 to 2147483647"),
    (["--max-new-tokens", "2.5"], "argument --max-new-tokens: must be a whole number from 1 to 2147483647, got '2.5'"),
    (["--batch-size", "1e3"], "argument --batch-size: must be a whole number from 1 to 2147483647, got '1e3'"),
    (["--buckets", "32,0"], "argument --buckets: must list numbers each a whole number from 1 to 2147483647"),
    (["--world-size", "2", "--master-port", "70000"], "argument --master-port: must be a whole number from 1 to 65535"),
    (["--world-size", "2", "--master-port", "0"], "argument --master-port: must be a whole number from 1 to 65535, got '0'"),
    (["--world-size", "0"], "argument --world-size: must be a whole number from 1 to 65536, got '0'"),
])
def test_a_number_out_of_range_is_refused_where_it_is_parsed(capsys, arguments, message):
    assert message in run_fails(capsys, "--prompt", "Hello", *arguments)


def test_the_ranges_are_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--seed SEED decides the sampled draws of every row (default 0); a whole number from 0 to 18446744073709551615" in help_text
    assert "--top-p TOP_P 1.0: off (default 1.0); a number above 0 and at most 1" in help_text


def test_the_python_api_checks_the_same_ranges():
    with pytest.raises(accelgen.UsageError, match=r"--temperature must be a number above 0 \(got nan\)"):
        accelgen.generate(["Hello"], device="cpu", do_sample=True, temperature=float("nan"))
    with pytest.raises(accelgen.UsageError, match=r"--seed must be a whole number from 0 to 18446744073709551615"):
        accelgen.generate(["Hello"], device="cpu", do_sample=True, seed=2**64)


def test_a_kv_cache_larger_than_free_memory_is_refused_before_it_is_allocated(capsys):
    error = run_fails(capsys, "--prompt", "Hello", "--max-new-tokens", "100000000")
    assert ("The KV cache and prefill activations for --batch-size 1 and 100,000,032 positions per row (prompt bucket + "
            "--max-new-tokens) need ") in error
    # the CPU's ranks share one memory: more of them would not help
    assert error.endswith(": lower --max-new-tokens or --buckets / --max-input-tokens (shorter rows).\n")


@pytest.mark.parametrize("arguments, fix", [
    (["--batch-size", "10000000"], r"--batch-size \d+ fits; or lower --max-new-tokens"),  # 4 TiB: more than any machine
    (["--buckets", "2147483647"], r": lower --max-new-tokens or --buckets / --max-input-tokens \(shorter rows\)\.$"),
])
def test_host_memory_is_checked_before_a_batch_or_bucket_too_large_for_it(cli_environment, tmp_path, arguments, fix):
    """On the CPU an allocation larger than the machine is granted lazily and the kernel then kills the process
    (exit 137, no word): the check comes first. Run in a process whose address space is capped below the
    machine's memory, so that a regression fails with an error here instead of taking the machine down. The batch
    comes with rows streamed from a dataset: their count is not known beforehand, so the slots are not cut to it."""
    limit = 12 * 2**30
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "Hello"}\n')
    source = ["--dataset", str(rows), "--streaming"] if "--batch-size" in arguments else ["--prompt", "Hello"]
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", *QUICK, *source, *arguments],
        env=cli_environment, capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("accelgen: error: The KV cache and prefill activations for ")
    assert re.search(fix, result.stderr.strip()), result.stderr


# -- prompts ------------------------------------------------------------------------------------

def test_prompt_bytes_that_are_not_utf8_are_refused(cli_environment):
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", *QUICK, "--prompt", os.fsdecode(b"caf\xe9")],
        env=cli_environment, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == ("accelgen: error: Prompt 0 is not UTF-8 text (byte 0xe9 at character 3): convert it to "
                             "UTF-8, e.g. with iconv -t UTF-8.\n")


def test_prompts_that_are_not_text_are_refused_by_the_python_api():
    with pytest.raises(accelgen.UsageError, match="Prompt 1 holds int, not text"):
        accelgen.generate(["Hello", 5], device="cpu", max_new_tokens=2)


def test_a_lone_surrogate_is_said_to_be_one_not_a_byte_that_is_not_utf8():
    with pytest.raises(accelgen.UsageError, match=r"^Prompt 1 holds a lone surrogate \(U\+D800 at character 2, half of a "
                                                  r"UTF-16 pair without its other half, which is no character\): remove "
                                                  r"it, or give it its pair\.$"):
        accelgen.generate(["Hello", "ab\ud800"], device="cpu", max_new_tokens=2)
    with pytest.raises(accelgen.UsageError, match=r"^Prompt 0 message 0 holds a lone surrogate \(U\+DFFF at character 0"):
        accelgen.generate([[{"role": "user", "content": "\udfff"}]], device="cpu", max_new_tokens=2)
