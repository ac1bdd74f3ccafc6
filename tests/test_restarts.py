"""Jobs that restart themselves (``--max-restarts``): a rank of a multi-process job SIGKILLed mid-dataset makes
torch's agent start the workers again, which resume from the output; the job ends with exit 0 and the file of an
uninterrupted run. Real jobs through the command line (two ranks over gloo, DeepSpeed's tensor parallelism)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import one_error_line_in, with_fault_drill
from test_data_parallel import worker_of

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# Data-parallel replicas wrote 24 rows' last ones within a tenth of a second, so a busy machine's test, polling the
# output to kill a rank after the first rows, could come after the job's end: their jobs get enough rows to outlast it
MORE_PROMPTS = [f"Row {number} tells of" + " a fox" * (number % 4) for number in range(160)]
PROMPTS = MORE_PROMPTS[:24]


def dataset_of(folder: Path, prompts=PROMPTS) -> str:
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": prompt}) + "\n" for prompt in prompts))
    return str(path)


def command_of(model, dataset, *options) -> list[str]:
    return [sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--model", str(model), "--dataset", dataset,
            "--max-new-tokens", "24", "--quiet", *options]


def run_with_a_rank_killed(command: list[str], output: Path, environment: dict, rank: int = 1, rows: int = 4,
                           timeout: float = 300) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``command`` into ``output``, SIGKILL its worker of rank ``rank`` once ``rows`` lines are written, and let
    the job go on to its end: how it ended, and how many lines were written when the rank was killed."""
    job = subprocess.Popen([*command, "--output", str(output)], env=environment, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (not output.exists() or output.read_text().count("\n") < rows):
        assert job.poll() is None, job.communicate()
        time.sleep(0.01)
    written = output.read_text().count("\n")
    os.kill(worker_of(environment, job_rank=rank), signal.SIGKILL)
    stdout, stderr = job.communicate(timeout=timeout)
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr), written


def whole_run(command: list[str], output: Path, environment: dict) -> None:
    result = subprocess.run([*command, "--output", str(output)], env=environment, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr


def restart_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "starting the workers again" in line]


@pytest.mark.parametrize("parallel, options, prompts", [
    (["--world-size", "2"], ["--batch-size", "2"], PROMPTS),
    (["--world-size", "2"], ["--batch-size", "2", "--overwrite"], PROMPTS),
    (["--world-size", "2"], ["--batch-size", "1", "--do-sample", "--seed", "7"], PROMPTS),
    (["--world-size", "2", "--data-parallel", "2"], ["--batch-size", "2"], MORE_PROMPTS),
    (["--world-size", "2", "--data-parallel", "2"], ["--batch-size", "1", "--do-sample", "--seed", "7"], MORE_PROMPTS),
], ids=["tensor-parallel-greedy", "tensor-parallel-overwrite", "tensor-parallel-sampled", "data-parallel-greedy", "data-parallel-sampled"])
def test_a_killed_rank_restarts_the_job_which_writes_the_uninterrupted_file(tiny_model_folder, tmp_path,
                                                                             job_environment, parallel, options, prompts):
    """Sampled rows run one slot each: a row's logits depend in their last bits on the rows it shares a step with
    (README, Resume), which a restart changes. With --overwrite, the first start replaces the file and the restarted
    workers resume it."""
    pytest.importorskip("deepspeed")
    command = command_of(tiny_model_folder("bloom"), dataset_of(tmp_path, prompts), *parallel, *options)
    if "--overwrite" in options:
        (tmp_path / "restarted.jsonl").write_text('{"an older": "run"}\n')
    ended, written = run_with_a_rank_killed(command, tmp_path / "restarted.jsonl", job_environment)
    assert ended.returncode == 0, ended.stderr
    assert written < len(prompts)
    lines = restart_lines(ended.stderr)
    assert lines == ["accelgen: worker rank 1 was killed by SIGKILL; starting the workers again (restart 1 of 3): "
                     "they resume from the output."], ended.stderr
    assert "(workers started again 1 time; figures since)" in ended.stderr
    assert "accelgen: resuming: " in ended.stderr  # the restarted workers resumed (with --overwrite too)
    whole_run(command, tmp_path / "whole.jsonl", job_environment)
    assert (tmp_path / "restarted.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()
    assert not (tmp_path / "restarted.jsonl.lock").exists()


def test_with_overwrite_a_rank_failing_before_any_row_is_written_still_replaces_the_older_output(tiny_model_folder,
                                                                                                 tmp_path,
                                                                                                 job_environment):
    """The restarted workers resume only what this job wrote: the output of an older run (another seed) is replaced
    as --overwrite asks. Before: the restarted workers resumed it, and refused it as another run's."""
    pytest.importorskip("deepspeed")
    output = tmp_path / "out.jsonl"
    command = command_of(tiny_model_folder("bloom"), dataset_of(tmp_path), "--world-size", "2", "--batch-size", "1",
                         "--do-sample")
    whole_run([*command, "--seed", "1"], output, job_environment)
    ended = subprocess.run([*command, "--seed", "2", "--overwrite", "--output", str(output)], capture_output=True,
                           text=True, timeout=300, env=with_fault_drill(job_environment, rank=1, first_start_only=True))
    assert ended.returncode == 0, ended.stderr
    assert len(restart_lines(ended.stderr)) == 1, ended.stderr
    assert "accelgen: resuming: " not in ended.stderr
    whole_run([*command, "--seed", "2"], tmp_path / "whole.jsonl", job_environment)
    assert output.read_text() == (tmp_path / "whole.jsonl").read_text()


def test_a_rank_that_keeps_failing_ends_the_job_after_its_restarts(tiny_model_folder, tmp_path, job_environment):
    pytest.importorskip("deepspeed")
    command = command_of(tiny_model_folder("bloom"), dataset_of(tmp_path), "--world-size", "2", "--max-restarts", "2",
                         "--output", str(tmp_path / "out.jsonl"))
    ended = subprocess.run(command, env=with_fault_drill(job_environment, rank=1), capture_output=True, text=True,
                           timeout=300)
    assert ended.returncode == 1
    assert len(restart_lines(ended.stderr)) == 2, ended.stderr
    assert "(restart 2 of 2)" in restart_lines(ended.stderr)[-1]
    last = ended.stderr.splitlines()[-1]
    assert last.startswith("accelgen: error: worker rank 1 failed: RuntimeError: injected fault on rank 1")
    assert last.endswith("(after 2 restarts)")


def test_a_mistake_in_the_rows_is_not_tried_again(tiny_model_folder, tmp_path, job_environment):
    """A row the run cannot take (too long for every bucket) stops the job at once, in one line, as before."""
    pytest.importorskip("deepspeed")
    prompts = [*PROMPTS[:6], "word " * 400, *PROMPTS[6:]]
    command = command_of(tiny_model_folder("bloom"), dataset_of(tmp_path, prompts), "--world-size", "2",
                         "--buckets", "32,64", "--output", str(tmp_path / "out.jsonl"))
    ended = subprocess.run(command, env=job_environment, capture_output=True, text=True, timeout=300)
    assert ended.returncode == 2
    assert not restart_lines(ended.stderr)
    assert "more than the largest bucket" in one_error_line_in(ended.stderr.splitlines(keepends=True)[-1])


@pytest.mark.parametrize("parallel", [["--world-size", "2"], ["--world-size", "2", "--data-parallel", "2"]],
                         ids=["tensor-parallel", "data-parallel"])
def test_a_job_whose_every_row_is_an_error_row_exits_3_once_without_a_restart(tiny_model_folder, tmp_path,
                                                                              job_environment, parallel):
    """Rank 0 says it and exits 3; the launcher passes the status on, adds no line and starts no worker again."""
    pytest.importorskip("deepspeed")
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text('{"text": null}\n' * 5)
    output = tmp_path / "out.jsonl"
    ended = subprocess.run(command_of(tiny_model_folder("bloom"), str(dataset), *parallel, "--skip-bad-rows",
                                      "--output", str(output)), env=job_environment, capture_output=True, text=True,
                           timeout=300)
    assert ended.returncode == 3, ended.stderr
    assert not restart_lines(ended.stderr) and "Traceback" not in ended.stderr
    assert ended.stderr.splitlines()[-1] == (
        f"accelgen: error: none of the 5 rows could be completed: each was written as an error row in {output} "
        f"(finish_reason \"error\", the reason in \"error\"): fix them, then run again with --overwrite.")
    assert [json.loads(line)["finish_reason"] for line in output.read_text().splitlines()] == ["error"] * 5
