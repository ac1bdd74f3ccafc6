"""Runs stopped, raced and resumed: sampled resume equals an uninterrupted run whatever the stop point, one
writer per output, a model known by its content, SIGINT ends a tensor-parallel job with no process left,
a stale DeepSpeed build lock is cleared instead of hanging every later job."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import extensions_folder_with_the_kernels

from accelgen.cli import main
from accelgen.loading.model_files import DEFAULT_MODEL

TEXTS = ["In the beginning", "And God said", "Let there be light", "And it was so", "And the evening", "Behold"]
SAMPLED = ["--device", "cpu", "--max-new-tokens", "6", "--quiet", "--do-sample", "--seed", "7", "--temperature", "1.3",
           "--batch-size", "2"]


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    return path


def run_record(output: Path) -> Path:
    return output.with_name(output.name + ".run.json")


@pytest.mark.parametrize("stopped_after", [1, 2, 3, 5])
def test_a_sampled_run_stopped_after_any_row_resumes_to_the_uninterrupted_output(dataset, tmp_path, capsys, stopped_after):
    whole = tmp_path / "whole.jsonl"
    assert main(["run", *SAMPLED, "--dataset", str(dataset), "--output", str(whole)]) == 0
    # a run stopped after `stopped_after` rows (odd: between the two row writes of one batch) left this
    stopped = tmp_path / "stopped.jsonl"
    stopped.write_bytes(b"".join(whole.read_bytes().splitlines(keepends=True)[:stopped_after]))
    shutil.copy(run_record(whole), run_record(stopped))
    capsys.readouterr()
    assert main(["run", *SAMPLED, "--dataset", str(dataset), "--output", str(stopped)]) == 0
    assert f"resuming: {stopped_after} rows already" in capsys.readouterr().err
    assert stopped.read_bytes() == whole.read_bytes()
    first = [json.loads(line)["completion_token_ids"] for line in whole.read_text().splitlines()]
    assert len({tuple(ids) for ids in first}) > 1  # sampled rows, not one text repeated


def test_a_second_run_on_an_output_in_use_is_refused_and_the_first_finishes_intact(dataset, tmp_path, cli_environment, capsys):
    output = tmp_path / "out.jsonl"
    arguments = ["run", *SAMPLED, "--max-new-tokens", "40", "--dataset", str(dataset), "--output", str(output)]
    first = subprocess.Popen([sys.executable, "-m", "accelgen.cli", *arguments], env=cli_environment,
                             stderr=subprocess.PIPE, text=True)
    lock = Path(str(output) + ".lock")
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text()) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert first.poll() is None, "the first run ended before the second started: make it longer"
    assert main([*arguments[:-6], "--seed", "8", "--dataset", str(dataset), "--output", str(output)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"accelgen: error: --output '{output}' is being written by another accelgen run (process "
                            f"{first.pid} on ") and error.count("\n") == 1
    assert first.wait(timeout=120) == 0, first.stderr.read()
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(len(TEXTS)))
    assert json.loads(run_record(output).read_text())["seed"] == 7
    assert not lock.exists()  # given up when the run ended


def test_a_lock_left_by_a_dead_run_is_taken_over(dataset, tmp_path):
    output = tmp_path / "out.jsonl"
    Path(str(output) + ".lock").write_text("process 4000000 on elsewhere, started 2026-01-01 00:00:00\n")
    assert main(["run", *SAMPLED, "--dataset", str(dataset), "--output", str(output)]) == 0
    assert len(output.read_text().splitlines()) == len(TEXTS)


def test_another_model_at_the_same_path_is_refused_and_the_same_model_by_another_path_resumes(dataset, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model = Path(shutil.copytree(DEFAULT_MODEL, tmp_path / "model"))
    output = tmp_path / "out.jsonl"
    arguments = ["run", *SAMPLED, "--dataset", str(dataset), "--output", str(output)]
    assert main([*arguments, "--model", str(model)]) == 0
    whole = output.read_bytes()
    output.write_bytes(b"".join(whole.splitlines(keepends=True)[:3]))
    same_model_elsewhere = Path(shutil.copytree(model, tmp_path / "elsewhere"))
    capsys.readouterr()
    assert main([*arguments, "--model", str(same_model_elsewhere)]) == 0
    assert "resuming: 3 rows already" in capsys.readouterr().err
    assert output.read_bytes() == whole
    # a fine-tune of the same shape, saved over the first model
    tuned = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        tuned.lm_head.weight.add_(0.01)
    tuned.save_pretrained(model)
    output.write_bytes(b"".join(whole.splitlines(keepends=True)[:3]))
    before = output.read_bytes()
    assert main([*arguments, "--model", str(model)]) == 2
    error = capsys.readouterr().err
    assert "holds completions of another run (different model_identity)" in error and error.count("\n") == 1
    assert output.read_bytes() == before


def _processes_with(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if marker.encode() in cmdline.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.slow
def test_sigint_ends_a_tensor_parallel_job_with_exit_130_and_no_process_left(tiny_model_folder, tmp_path, cli_environment):
    pytest.importorskip("deepspeed")
    marker = str(tmp_path / "sigint-out.jsonl")  # in every rank's command line
    job = subprocess.Popen(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--world-size", "2", "--model",
         str(tiny_model_folder("llama")), "--max-new-tokens", "200", "--ignore-eos", "--quiet",
         *[argument for text in TEXTS * 20 for argument in ("--prompt", text)], "--output", marker],
        env=cli_environment, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 180
    while not (Path(marker).exists() and Path(marker).stat().st_size) and time.monotonic() < deadline:
        assert job.poll() is None, job.stderr.read()
        time.sleep(0.05)
    job.send_signal(signal.SIGINT)
    assert job.wait(timeout=60) == 130
    assert "accelgen: interrupted (SIGINT); all workers stopped" in job.stderr.read()
    deadline = time.monotonic() + 30  # the launcher has reaped its ranks; their entries in /proc go as they are reaped
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == []


@pytest.mark.slow
def test_a_stale_deepspeed_build_lock_is_cleared_in_one_line_not_a_hang(tiny_model_folder, tmp_path, cli_environment):
    pytest.importorskip("deepspeed")
    from accelgen_cpu.extension_lock import deepspeed_build_folder

    extensions = extensions_folder_with_the_kernels(tmp_path / "extensions")
    built = Path(deepspeed_build_folder())
    this_install = extensions / built.relative_to(built.parent.parent)  # accelgen-deepspeed-<key>/deepspeed_shm_comm
    if built.is_dir():  # the extension compiled already (by an earlier test): no compile needed here
        shutil.copytree(built, this_install, ignore=shutil.ignore_patterns("lock"))
    lock = this_install / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # left an hour ago by a stopped job
    result = subprocess.run(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--world-size", "2", "--model",
         str(tiny_model_folder("llama")), "--max-new-tokens", "3", "--quiet", "--prompt", "Hello"],
        env=dict(cli_environment, TORCH_EXTENSIONS_DIR=str(extensions)), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("accelgen: warning:")]
    assert warnings == [f"accelgen: warning: removed {lock}, left by a compile of DeepSpeed's CPU all-reduce extension "
                        f"that was stopped (no process is compiling it); every tensor-parallel job would have waited on "
                        f"it for ever"]


@pytest.mark.slow
def test_a_killed_launcher_takes_its_ranks_with_it(tiny_model_folder, tmp_path, cli_environment):
    """SIGKILL to the launcher (no handler of its own can run): the ranks end too, none waits for ever."""
    pytest.importorskip("deepspeed")
    marker = str(tmp_path / "killed-out.jsonl")
    job = subprocess.Popen(
        [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--world-size", "2", "--model",
         str(tiny_model_folder("llama")), "--max-new-tokens", "200", "--ignore-eos", "--quiet",
         *[argument for text in TEXTS * 20 for argument in ("--prompt", text)], "--output", marker],
        env=cli_environment, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while not (Path(marker).exists() and Path(marker).stat().st_size) and time.monotonic() < deadline:
        assert job.poll() is None
        time.sleep(0.05)
    assert len(_processes_with(marker)) == 3  # the launcher and its two ranks
    job.kill()
    job.wait()
    deadline = time.monotonic() + 30
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker) == []


def test_a_file_system_without_locks_is_one_line(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    def no_locks(file, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)  # as on a network file system without lock support
    output = tmp_path / "out.jsonl"
    assert main(["run", *SAMPLED, "--prompt", "Hello", "--output", str(output)]) == 2
    error = capsys.readouterr().err
    assert error == (f"accelgen: error: Cannot lock --output '{output}' (through '{output}.lock'): No locks available: "
                     f"choose an --output on a file system that supports locks (a local disk)\n")
    assert not output.exists()
