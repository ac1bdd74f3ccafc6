"""Processes at the wrong moment. Ctrl-C in the middle of a CPU dataset job, once rows have started, with the decode step traced into TorchScript (a
short job's) and compiled (``--graphs``): one line and exit 130, the rows finished kept, and the same command resumes
to the end with no row lost or written twice.

A Ctrl-C that lands while the traced step runs is raised inside a Python operation of its graph (Bloom's GeLU is an
autograd function): TorchScript's interpreter turned that KeyboardInterrupt into a RuntimeError, shown as a
132-line traceback with exit 1. The Bloom here has sixteen layers and a small vocabulary, so that nearly all of a job's
time is its decode steps before their last GeLU: a Ctrl-C sent a moment after the first rows lands there.

A job of many samples (``--num-samples 65536``) says at once how many it has to make, before its first samples: their
prompt's prefill is given to each of them first, which took long enough that a user saw no progress line at all."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import as_a_terminal_starts_it, run_to_the_end
from tiny_models import BOS_ID, EOS_ID, PAD_ID, build_model, build_tokenizer

#: Bounds on a hang, generous for a loaded machine (the compiled step's first compile takes a minute or two there)
START_TIMEOUT = 600
END_TIMEOUT = 120


@pytest.fixture(scope="module")
def long_step_bloom(tmp_path_factory) -> Path:
    """A Bloom whose decode step is many layers long (its Python GeLU in each) beside little else."""
    from transformers import BloomConfig

    folder = tmp_path_factory.mktemp("long_step_bloom")
    tokenizer = build_tokenizer(folder)
    config = BloomConfig(hidden_size=256, n_layer=16, n_head=4, vocab_size=len(tokenizer), bos_token_id=BOS_ID,
                         eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    return build_model(folder, config)


def interrupted_then_resumed(model: Path, rows: int, tmp_path: Path, environment: dict, *options: str) -> list[dict]:
    """Run a dataset job, Ctrl-C it once two rows are out, check its one line, run the same command to the end; the
    rows of the output."""
    dataset, output = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    dataset.write_text("".join(json.dumps({"text": f"Row {number} about the sea"}) + "\n" for number in range(rows)))
    command = [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(model), "--dataset",
               str(dataset), "--max-new-tokens", "48", "--output", str(output), "--quiet", *options]
    run = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           preexec_fn=as_a_terminal_starts_it)
    deadline = time.monotonic() + START_TIMEOUT
    while (not output.exists() or output.read_text().count("\n") < 2) and run.poll() is None:
        assert time.monotonic() < deadline, "no row was written"
        time.sleep(0.01)
    time.sleep(0.5)  # inside the next row's decode steps
    run.send_signal(signal.SIGINT)
    _, stderr = run.communicate(timeout=END_TIMEOUT)
    assert run.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == (f"accelgen: interrupted: the rows finished are kept in {output}, and "
                                               f"the same command resumes"), stderr  # during rows: some were kept
    assert "Traceback" not in stderr and "Error" not in stderr
    kept = output.read_text().count("\n")
    assert 2 <= kept < rows
    resumed = run_to_the_end(command, environment, timeout=START_TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr
    return [json.loads(line) for line in output.read_text().splitlines()]


def test_ctrl_c_inside_the_traced_step_is_one_line_and_the_job_resumes(long_step_bloom, tmp_path, cli_environment):
    lines = interrupted_then_resumed(long_step_bloom, 12, tmp_path, cli_environment)
    assert [line["index"] for line in lines] == list(range(12))  # none lost, none written twice


def test_ctrl_c_inside_the_compiled_step_is_one_line_and_the_job_resumes(tiny_model_folder, tmp_path,
                                                                         cli_environment):
    lines = interrupted_then_resumed(tiny_model_folder("bloom"), 120, tmp_path, cli_environment, "--graphs")
    assert [line["index"] for line in lines] == list(range(120))


def test_a_job_of_many_samples_says_its_progress_before_the_first_samples(tiny_model_folder, cli_environment):
    """Before: the first progress line came with the first sample, tens of seconds in, its rate counting that wait
    (0.08 samples/s, ETA 772485 s)."""
    run = subprocess.Popen([sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model",
                            str(tiny_model_folder("llama")), "--prompt", "Hello", "--num-samples", "65536",
                            "--do-sample", "--max-new-tokens", "2"], env=cli_environment, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, preexec_fn=as_a_terminal_starts_it)
    try:
        first = next((line for line in run.stderr if " rows, " in line), None)
    finally:
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=END_TIMEOUT)
    assert first is not None and first.startswith("accelgen: 0/1 rows, 0/65,536 samples"), first
