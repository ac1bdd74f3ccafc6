"""The CPU plugin chooses its threads from the machine as it finds it (cores it may use, cores other processes keep
busy, ranks of the job on the node), says what it chose in the summary, and keeps a thread count the user set as the
most it computes with (fewer while other processes keep its cores busy: test_cpu_load_follower.py).

The jobs here start without the suite's OMP_NUM_THREADS (conftest), pinned to chosen cores so that what they find
does not depend on the machine running the suite."""

import os
import re
import subprocess
import sys

import pytest

from accelgen_cpu.threads import choose_threads

#: Bounds on a hang, generous for a loaded machine: they time nothing.
JOB_TIMEOUT = 600


def two_cores() -> set[int]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores to pin a job to")
    return set(cores[:2])


def run_pinned(cores: set[int], environment: dict, *arguments: str) -> subprocess.CompletedProcess:
    """``accelgen run ARGUMENTS`` on ``cores`` only (its CPU affinity, as ``taskset`` sets it)."""
    return subprocess.run([sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--prompt", "Hello",
                           "--max-new-tokens", "3", "--details", *arguments], env=environment, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT, preexec_fn=lambda: os.sched_setaffinity(0, cores))


def device_phrase(stderr: str) -> str:
    [phrase] = re.findall(r"device cpu \((.*?)\), dtype ", stderr)
    return phrase


@pytest.fixture
def unset_threads(cli_environment) -> dict:
    return {name: value for name, value in cli_environment.items() if name not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}


@pytest.fixture
def busy_processes():
    """``busy_processes(cores, count)``: processes that keep ``count`` cores of ``cores`` busy, stopped after."""
    started = []

    def start(cores: set[int], count: int):
        for _ in range(count):
            started.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                            preexec_fn=lambda: os.sched_setaffinity(0, cores)))

    yield start
    for process in started:
        process.kill()
        process.wait()


@pytest.mark.parametrize(("cores", "busy", "ranks", "threads"), [
    (2, 0.0, 1, 2), (2, 0.3, 1, 2), (2, 0.6, 1, 1), (2, 2.0, 1, 1), (2, 5.0, 1, 1),
    (16, 4.2, 1, 12), (16, 0.0, 4, 4), (16, 4.0, 4, 3), (2, 0.0, 4, 1),
])
def test_threads_are_the_idle_cores_split_between_the_ranks(cores, busy, ranks, threads):
    assert choose_threads(cores, busy, ranks) == threads


def test_a_run_on_idle_cores_takes_each_of_them_and_says_so(tiny_model_folder, unset_threads):
    cores = two_cores()
    result = run_pinned(cores, unset_threads, "--model", str(tiny_model_folder("llama")))
    assert result.returncode == 0, result.stderr
    phrase = device_phrase(result.stderr)
    # the suite's own processes may keep one of the two cores busy meanwhile: then the run takes the other one
    assert re.fullmatch(r"(2 threads|1 thread) of 2 cores(, [0-9.]+ kept busy by other processes)?", phrase), phrase


def test_other_processes_busy_on_its_cores_leave_a_run_one_thread(tiny_model_folder, unset_threads, busy_processes):
    cores = two_cores()
    busy_processes(cores, 2)
    result = run_pinned(cores, unset_threads, "--model", str(tiny_model_folder("llama")))
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"1 thread of 2 cores, [0-9.]+ kept busy by other processes",
                        device_phrase(result.stderr)), result.stderr


def test_one_core_of_affinity_is_one_thread(tiny_model_folder, unset_threads):
    result = run_pinned({min(os.sched_getaffinity(0))}, unset_threads, "--model", str(tiny_model_folder("llama")))
    assert result.returncode == 0, result.stderr
    assert device_phrase(result.stderr).startswith("1 thread of 1 core")


@pytest.mark.parametrize("threads", ["1", "2"])
def test_your_omp_num_threads_is_kept(tiny_model_folder, unset_threads, busy_processes, threads):
    cores = two_cores()
    busy_processes(cores, 2)  # the plugin would choose one thread here (two cores: torch runs at most two)
    result = run_pinned(cores, dict(unset_threads, OMP_NUM_THREADS=threads), "--model", str(tiny_model_folder("llama")))
    assert result.returncode == 0, result.stderr
    chosen = f"{threads} thread{'' if threads == '1' else 's'}: your OMP_NUM_THREADS"
    # two threads under that load may go down to one during the run, and the summary says so
    followed = "; 1 thread while other processes kept cores busy \\([0-9]+% of the run\\)" if threads == "2" else ""
    assert re.fullmatch(re.escape(chosen) + f"({followed})?", device_phrase(result.stderr)), result.stderr


@pytest.mark.slow
def test_ranks_on_one_node_split_its_cores(tiny_model_folder, unset_threads):
    pytest.importorskip("deepspeed")
    cores = two_cores()
    result = run_pinned(cores, unset_threads, "--model", str(tiny_model_folder("llama")), "--world-size", "2")
    assert result.returncode == 0, result.stderr
    assert device_phrase(result.stderr).startswith("1 thread of 2 cores"), result.stderr
    assert device_phrase(result.stderr).endswith("shared by 2 ranks"), result.stderr
