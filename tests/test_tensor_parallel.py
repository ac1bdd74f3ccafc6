"""Tensor parallelism for real: `accelgen run --world-size 2` starts two processes that talk over gloo."""

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from accelerators import plugin_manager_with
from conftest import one_error_line, run_to_the_end, shared_memory_buffers_of, with_fault_drill
from family_models import FAMILIES, skip_unless_installed

import accelgen
from accelgen.cli import main
from accelgen.common.errors import UsageError
from accelgen.common.settings import LaunchPlan
from accelgen.model.architectures import ARCHITECTURES
from accelgen.parallel.launcher import JobEnd, free_port, launch_job, launch_with_torchrun

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.slow

PROMPTS = ["DeepSpeed is a machine learning framework", "Hello", "The quick brown fox jumps"]
MAX_NEW_TOKENS = 10


def accelgen_command(*arguments):
    return [sys.executable, "-m", "accelgen.cli", *arguments]


def processes_of(environment) -> list[int]:
    """PIDs of live processes carrying this job's marker in their environment."""
    marker = f"ACCELGEN_TEST_JOB={environment['ACCELGEN_TEST_JOB']}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def run_job(environment, *arguments, timeout=240):
    return run_to_the_end(accelgen_command("run", *arguments), environment, timeout)


def rows_of(path):
    # lines end at \n only: str.splitlines() also splits at characters a completion may hold (U+0085, U+2028)
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").split("\n") if line]


@pytest.mark.transformers_release
@pytest.mark.parametrize(
    "architecture, batch_size", [("bloom", 2), ("bloom", 1), ("llama", 2), ("llama", 1), ("opt", 2)]
)
def test_two_ranks_generate_what_one_process_generates(
    tiny_model_folder, tmp_path, job_environment, architecture, batch_size
):
    folder = str(tiny_model_folder(architecture))
    output = tmp_path / "out.jsonl"
    port = free_port()
    prompt_arguments = [argument for prompt in PROMPTS for argument in ("--prompt", prompt)]
    result = run_job(job_environment, "--device", "cpu", "--world-size", "2", "--model", folder, *prompt_arguments,
                     "--batch-size", str(batch_size), "--max-new-tokens", str(MAX_NEW_TOKENS), "--output", str(output),
                     "--master-port", str(port), "--details")
    assert result.returncode == 0, result.stderr
    # DeepSpeed's shared-memory all-reduce buffers are not left behind in /dev/shm
    assert not shared_memory_buffers_of(port)

    expected = accelgen.generate(PROMPTS, model=folder, device="cpu", batch_size=batch_size,
                                 max_new_tokens=MAX_NEW_TOKENS)
    assert [row["completion_token_ids"] for row in rows_of(output)] == [c.completion_token_ids for c in expected]
    # only rank 0 printed: each prompt once, and nothing but completions (DeepSpeed's lines go to stderr)
    assert result.stdout.count("Input: ") == len(PROMPTS)
    assert "built successfully" not in result.stdout and "Setting accelerator" not in result.stdout, result.stdout
    assert "world size 2" in result.stderr

    # each rank holds only its shard: at most 0.6x the unsharded parameter bytes
    shares = re.search(r"parameter bytes per rank ([\d,]+) / ([\d,]+) of ([\d,]+) unsharded", result.stderr)
    rank0, rank1, unsharded = (int(group.replace(",", "")) for group in shares.groups())
    assert rank0 == rank1
    assert rank0 <= 0.6 * unsharded
    assert processes_of(job_environment) == []


def test_a_tensor_parallel_run_says_only_what_accelgen_says(tiny_model_folder, tmp_path, job_environment):
    """DeepSpeed's own lines (its accelerator chosen at import, its kernel's build, its logger's notes), from every
    rank, never reach the user: with --quiet, nothing on stdout and only accelgen's lines on stderr."""
    result = run_job(job_environment, "--device", "cpu", "--world-size", "2", "--model", str(tiny_model_folder("bloom")),
                     "--prompt", PROMPTS[0], "--max-new-tokens", "4", "--quiet", "--output", str(tmp_path / "out.jsonl"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines and all(line.startswith("accelgen: ") for line in lines), result.stderr


DEEPSPEED_SPEAKS = """
import logging
from accelgen.parallel.deepspeed_adapter import deepspeed_quiet
with deepspeed_quiet():
    import deepspeed  # its logger's handler is made now, on the block's stream; its accelerator says it is chosen
    print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
    print("a line DeepSpeed printed that is not chatter", end="")
logging.getLogger("DeepSpeed").warning("a warning of DeepSpeed's own")
logging.getLogger("DeepSpeed").error("an error of DeepSpeed's own")
"""


def test_deepspeeds_errors_still_show_and_its_chatter_does_not(cli_environment):
    """In a fresh process (DeepSpeed's logger is made at its first import)."""
    result = subprocess.run([sys.executable, "-c", DEEPSPEED_SPEAKS], env=cli_environment, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert "a line DeepSpeed printed that is not chatter" in result.stderr
    assert "an error of DeepSpeed's own" in result.stderr
    for chatter in ("Setting accelerator", "built successfully", "a warning of DeepSpeed's own"):
        assert chatter not in result.stderr, result.stderr


def test_two_ranks_compile_their_decode_step_and_generate_what_one_process_generates(
    tiny_model_folder, tmp_path, job_environment
):
    """With --graphs each rank compiles its step, whose all-reduce (DeepSpeed's operator) inductor's C++ wrapper
    cannot call: the step is compiled with the Python wrapper instead, not left eager."""
    folder = str(tiny_model_folder("llama"))
    output = tmp_path / "out.jsonl"
    prompt_arguments = [argument for prompt in PROMPTS for argument in ("--prompt", prompt)]
    result = run_job(job_environment, "--device", "cpu", "--world-size", "2", "--model", folder, *prompt_arguments,
                     "--batch-size", "2", "--max-new-tokens", str(MAX_NEW_TOKENS), "--graphs", "--output", str(output),
                     "--master-port", str(free_port()), "--details")
    assert result.returncode == 0, result.stderr
    assert "graph captures: 1" in result.stderr and "cannot capture" not in result.stderr, result.stderr
    expected = accelgen.generate(PROMPTS, model=folder, device="cpu", batch_size=2, max_new_tokens=MAX_NEW_TOKENS)
    assert [row["completion_token_ids"] for row in rows_of(output)] == [c.completion_token_ids for c in expected]


def test_two_nodes_on_one_machine_generate_the_same(tiny_model_folder, tmp_path, job_environment):
    """--nnodes 2: one launcher per node, meeting at node 0's address (here both on localhost)."""
    folder = str(tiny_model_folder("llama"))
    output = tmp_path / "out.jsonl"
    port = free_port()
    common = ["--device", "cpu", "--world-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--model", folder, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
              "--batch-size", "2", "--max-new-tokens", str(MAX_NEW_TOKENS)]
    nodes = [
        subprocess.Popen(accelgen_command("run", *common, "--node-rank", str(rank), "--output", str(output)),
                         env=job_environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    results = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], results
    expected = accelgen.generate(PROMPTS[:2], model=folder, device="cpu", batch_size=2, max_new_tokens=MAX_NEW_TOKENS)
    assert [row["completion_token_ids"] for row in rows_of(output)] == [c.completion_token_ids for c in expected]


def test_accelgen_runs_under_torchrun_started_by_hand(tiny_model_folder, tmp_path, job_environment):
    folder = str(tiny_model_folder("bloom"))
    output = tmp_path / "out.jsonl"
    result = run_to_the_end(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "accelgen.cli", "run", "--device", "cpu", "--model", folder, "--prompt", "Hello",
         "--max-new-tokens", str(MAX_NEW_TOKENS), "--output", str(output)], job_environment, timeout=240)
    assert result.returncode == 0, result.stderr
    [expected] = accelgen.generate(["Hello"], model=folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS)
    assert [row["completion_token_ids"] for row in rows_of(output)] == [expected.completion_token_ids]


def test_a_failing_worker_ends_the_whole_job(tiny_model_folder, job_environment):
    """Rank 1 raises after loading while rank 0 waits for it inside an all-reduce."""
    environment = with_fault_drill(job_environment)
    result = run_job(environment, "--device", "cpu", "--world-size", "2", "--model", str(tiny_model_folder("llama")),
                     "--prompt", "Hello", "--max-new-tokens", "200", "--max-restarts", "0", timeout=120)
    assert result.returncode == 1
    assert "accelgen: error: worker rank 1 failed: RuntimeError: injected fault on rank 1" in result.stderr
    assert processes_of(environment) == []


def test_ctrl_c_stops_every_worker(tiny_model_folder, job_environment):
    launcher = subprocess.Popen(
        accelgen_command("run", "--device", "cpu", "--world-size", "2", "--model", str(tiny_model_folder("llama")),
                         *[argument for _ in range(400) for argument in ("--prompt", "Hello")],
                         "--max-new-tokens", "50", "--ignore-eos"),
        env=job_environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    for line in launcher.stdout:
        if line == "Batch n°1\n":  # the workers are generating
            break
    launcher.send_signal(signal.SIGINT)  # to the launcher alone, as a supervisor would
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 130
    assert "all workers stopped" in stderr
    deadline = time.monotonic() + 30
    while processes_of(job_environment) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of(job_environment) == []


@pytest.mark.transformers_release
def test_a_model_autotp_cannot_shard_is_one_line(tiny_model_folder, job_environment):
    port = free_port()
    result = run_job(job_environment, "--device", "cpu", "--world-size", "2", "--master-port", str(port), "--model",
                     str(tiny_model_folder("gpt2")), "--prompt", "Hello", "--max-new-tokens", "4")
    assert result.returncode == 2
    [line] = [line for line in result.stderr.splitlines() if line.startswith("accelgen: error:")]
    assert "DeepSpeed cannot shard GPT2LMHeadModel with AutoTP" in line and "--world-size 1" in line
    # DeepSpeed made its shared-memory all-reduce buffers before it refused the model: the failed job removed them
    assert not shared_memory_buffers_of(port)


#: A plugin replacing the CPU accelerator by one whose capture pays after 40 decode steps and runs the step twice over
#: the buffers it is given (as warm-ups and a compiler's first call do), a freed slot refilled at once.
CPU_CAPTURING_SOON = """
import dataclasses

import accelgen
from accelgen_cpu import CpuAccelerator


class CpuCapturingSoon(CpuAccelerator):
    tuning = dataclasses.replace(CpuAccelerator.tuning, capture_pays_after_steps=40, prefill_pass_steps=0)
    warm_capture_pays_after_steps = 40

    def capture(self, step, example_inputs, run):
        for _ in range(2):
            step(*example_inputs)
        return step


@accelgen.hookimpl
def accelgen_register_accelerators(register):
    register(CpuCapturingSoon())
"""


def test_ranks_capture_their_step_at_the_same_look_of_a_job_found_long_enough(tiny_model_folder, tmp_path,
                                                                              job_environment):
    """The capture of a job that starts eagerly is decided by each rank from the rows that have ended, and runs the
    step (its all-reduces) while rows run: the ranks decide alike, at the same look, or one would wait for ever on
    the other's collectives. Sampled rows ending on a stop text: the tokens of one process, eager."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "accelgen_capturing_soon.py").write_text(CPU_CAPTURING_SOON)
    metadata = site / "accelgen_capturing_soon-0.1.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: accelgen-capturing-soon\nVersion: 0.1\n")
    (metadata / "entry_points.txt").write_text("[accelgen]\ncapturing-soon = accelgen_capturing_soon\n")
    folder = str(tiny_model_folder("llama"))
    texts = [f"{PROMPTS[number % len(PROMPTS)]} {number}" for number in range(48)]
    output = tmp_path / "out.jsonl"
    sampling = ["--do-sample", "--seed", "7", "--temperature", "1.3", "--stop", "s"]
    result = run_job(dict(job_environment, PYTHONPATH=str(site)), "--device", "cpu", "--world-size", "2", "--model",
                     folder, *[argument for text in texts for argument in ("--prompt", text)], "--batch-size", "4",
                     "--max-new-tokens", "20", *sampling, "--output", str(output), "--quiet", "--details")
    assert result.returncode == 0, result.stderr
    assert "graph captures: 1" in result.stderr
    expected = accelgen.generate(texts, model=folder, device="cpu", batch_size=4, max_new_tokens=20, do_sample=True,
                                 seed=7, temperature=1.3, stop=["s"])
    rows = rows_of(output)
    assert [row["completion_token_ids"] for row in rows] == [c.completion_token_ids for c in expected]
    assert {"stop", "length"} <= {row["finish_reason"] for row in rows}


#: /dev/shm as a job may find it: full (another job's buffers fill it), or a container's default (64 MiB)
SHORT_SHARED_MEMORY = {
    "full": "mount -t tmpfs -o size=1m tmpfs /dev/shm && (cat /dev/zero > /dev/shm/fill 2>/dev/null; true)",
    "a-container-default": "mount -t tmpfs -o size=64m tmpfs /dev/shm",
}


def with_shared_memory(setup: str, command: list[str]) -> list[str]:
    """``command`` run with a /dev/shm of its own (a mount namespace), as ``setup`` makes it."""
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", f'{setup} && exec "$@"', "sh", *command]


def can_give_a_process_its_own_shared_memory() -> bool:
    try:
        return subprocess.run(with_shared_memory(SHORT_SHARED_MEMORY["full"], ["true"]), capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.transformers_release
@pytest.mark.parametrize("shared_memory", sorted(SHORT_SHARED_MEMORY))
def test_a_job_short_of_shared_memory_reduces_over_gloo_and_says_so(tiny_model_folder, tmp_path, job_environment,
                                                                    shared_memory):
    """DeepSpeed writes each rank's all-reduce buffer (66 MiB) into /dev/shm unchecked: on a full one its ranks died
    with SIGSEGV while they joined (as once in CI), on a 64 MiB one with SIGSEGV or, at a large all-reduce, SIGBUS.
    The job now reduces over gloo, says why in one line, and generates what one process generates."""
    if not can_give_a_process_its_own_shared_memory():
        pytest.skip("this machine lets no process mount a /dev/shm of its own (unshare --user --mount is refused)")
    folder = str(tiny_model_folder("bloom"))
    output = tmp_path / "out.jsonl"
    prompt_arguments = [argument for prompt in PROMPTS for argument in ("--prompt", prompt)]
    command = accelgen_command("run", "--device", "cpu", "--world-size", "2", "--model", folder, *prompt_arguments,
                               "--max-new-tokens", str(MAX_NEW_TOKENS), "--output", str(output))
    result = run_to_the_end(with_shared_memory(SHORT_SHARED_MEMORY[shared_memory], command), job_environment, 240)
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "shared-memory all-reduce" in line]
    assert line.startswith("accelgen: warning: DeepSpeed's shared-memory all-reduce needs 66 MiB of /dev/shm per rank "
                           "and a rank could not have it (No space left on device; ") and "--shm-size=1g" in line
    expected = accelgen.generate(PROMPTS, model=folder, device="cpu", max_new_tokens=MAX_NEW_TOKENS)
    assert [row["completion_token_ids"] for row in rows_of(output)] == [c.completion_token_ids for c in expected]


def test_the_cpu_removes_the_buffers_its_ranks_on_this_node_left_once_they_have_ended():
    """A rank killed while DeepSpeed joined (after it made its shared-memory all-reduce buffer, before it could remove
    the name) leaves the buffer in /dev/shm: the launcher has the CPU plugin remove this node's ranks' names of the
    job's address and port once its ranks have ended; other nodes' ranks and other jobs keep theirs."""
    from accelgen_cpu import CpuAccelerator

    port, other_port = free_port(), free_port()
    plan = LaunchPlan(world_size=4, nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=port)
    buffers = {(job_port, rank): Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{job_port}_{rank}")
               for job_port in (port, other_port) for rank in range(4)}
    try:
        for path in buffers.values():
            path.write_bytes(b"left")
        CpuAccelerator().clean_up_after_workers(plan)
        assert {key for key, path in buffers.items() if not path.exists()} == {(port, 2), (port, 3)}
    finally:
        for path in buffers.values():
            path.unlink(missing_ok=True)


class CleaningAccelerator(accelgen.Accelerator):
    """A device whose launcher command fails at once, and which records that it was asked to clean up."""

    name = "cleaning"
    cleaned: list = []

    def is_available(self):
        return True

    def setup(self, world):
        raise AssertionError("no rank starts")

    def launch_command(self, worker_argv, plan):
        return [sys.executable, "-c", "raise SystemExit(3)"]

    def clean_up_after_workers(self, plan):
        self.cleaned.append(plan)


def test_the_launcher_has_the_device_clean_up_after_its_workers_however_they_ended():
    accelerator = CleaningAccelerator()
    plan = LaunchPlan(world_size=2, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=free_port())
    assert launch_job(accelerator, plan, ["run"]).status != 0
    assert accelerator.cleaned == [plan]


class OneGpuAccelerator(accelgen.Accelerator):
    """A device with one card per rank and only one card here."""

    name = "onecard"
    one_process_per_device = True

    def is_available(self):
        return True

    def setup(self, world):
        raise AssertionError("the launch is refused before any rank starts")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--world-size", "0"], "argument --world-size: must be a whole number from 1 to 65536, got '0'"),
        (["--world-size", "-2"], "argument --world-size: must be a whole number from 1 to 65536, got '-2'"),
        (["--world-size", "3", "--nnodes", "2"], "--world-size 3 must be a multiple of --nnodes 2"),
        (["--world-size", "2", "--device", "onecard"], "--world-size 2 needs 2 onecard devices on this node, which has 1"),
        (["--world-size", "3"], "The model has 4 attention heads, which do not split over --world-size 3: use a world size that divides 4 (1, 2, 4)"),
    ],
)
def test_bad_parallel_settings_are_one_line(tiny_model_folder, capsys, arguments, message):
    plugin_manager = plugin_manager_with(OneGpuAccelerator())
    argv = ["run", "--device", "cpu", "--model", str(tiny_model_folder("llama")), "--prompt", "a", *arguments]
    assert main(argv, plugin_manager) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error


@pytest.mark.transformers_release
def test_multi_query_model_cannot_split_its_single_key_value_head(tiny_model_folder, capsys):
    argv = ["run", "--device", "cpu", "--model", str(tiny_model_folder("falcon")), "--prompt", "a", "--world-size", "2"]
    assert main(argv) == 2
    assert "The model has 1 key/value heads, which do not split over --world-size 2" in capsys.readouterr().err


def test_a_port_in_use_is_one_line(tiny_model_folder, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["run", "--device", "cpu", "--model", str(tiny_model_folder("llama")), "--prompt", "a",
                "--world-size", "2", "--master-port", str(port)]
        assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"Cannot use --master-port {port} on 127.0.0.1" in error


def test_a_picked_port_another_process_takes_before_the_agent_listens_is_picked_again(tiny_model_folder):
    """Between picking a free port and torch's agent listening on it, another process (a job starting beside this
    one) may take the port: a port picked by the launcher is picked again; a port the user named is reported."""
    argv = ["run", "--device", "cpu", "--model", str(tiny_model_folder("llama")), "--prompt", "a",
            "--max-new-tokens", "2", "--world-size", "2"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        picked = LaunchPlan(2, 1, 0, "127.0.0.1", port, port_given=False)
        assert launch_with_torchrun(argv, picked) == JobEnd(0)
        with pytest.raises(UsageError, match=f"^Cannot use --master-port {port} on 127.0.0.1: another job took it "):
            launch_with_torchrun(argv, dataclasses.replace(picked, port_given=True))


#: The families of family_models that split over ranks (those with experts, and OLMo 2, are refused: see below).
SPLIT_FAMILIES = [family for family in FAMILIES if ARCHITECTURES[family].not_split_because is None]


@pytest.mark.parametrize("family", SPLIT_FAMILIES)
def test_two_ranks_of_each_family_generate_what_one_process_generates(tiny_model_folder, tmp_path, job_environment,
                                                                       family):
    skip_unless_installed(family)
    folder = str(tiny_model_folder(family))
    output = tmp_path / "out.jsonl"
    prompt_arguments = [argument for prompt in PROMPTS for argument in ("--prompt", prompt)]
    result = run_job(job_environment, "--device", "cpu", "--world-size", "2", "--model", folder, *prompt_arguments,
                     "--batch-size", "2", "--max-new-tokens", str(MAX_NEW_TOKENS), "--output", str(output),
                     "--master-port", str(free_port()), "--details")
    assert result.returncode == 0, result.stderr
    expected = accelgen.generate(PROMPTS, model=folder, device="cpu", batch_size=2, max_new_tokens=MAX_NEW_TOKENS)
    assert [row["completion_token_ids"] for row in rows_of(output)] == [c.completion_token_ids for c in expected]
    shares = re.search(r"parameter bytes per rank ([\d,]+) / ([\d,]+) of ([\d,]+) unsharded", result.stderr)
    rank0, rank1, unsharded = (int(group.replace(",", "")) for group in shares.groups())
    assert rank0 <= 0.6 * unsharded and rank1 <= 0.6 * unsharded


@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in SPLIT_FAMILIES])
def test_a_family_that_does_not_split_is_refused_in_one_line_before_any_rank_starts(tiny_model_folder, capsys, family):
    skip_unless_installed(family)
    folder = str(tiny_model_folder(family))
    assert main(["run", "--device", "cpu", "--world-size", "2", "--model", folder, "--prompt", "Hello"]) == 2
    message = one_error_line(capsys)
    assert f"{ARCHITECTURES[family].not_split_because}" in message and "--world-size 1" in message
