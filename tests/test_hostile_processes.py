"""Processes at the wrong moment: a launcher killed or interrupted while its ranks start, a rank killed or
stopped, two jobs on one port, an unwritable HOME, a build lock nobody holds or a compile holds for long. Each job
ends in one line (or none, killed) with its exit status, and leaves no process behind."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import extensions_folder_with_the_kernels
from stderr_lines import StderrLines

from accelgen.parallel.launcher import free_port

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.slow

#: How long a job may take to start its ranks, or to end: bounds on a hang, generous for a loaded machine, they time
#: nothing.
START_TIMEOUT = 300
END_TIMEOUT = 300


class Job:
    """``python -m accelgen.cli ARGUMENTS`` in the background, its processes found by the environment's marker
    (``ACCELGEN_TEST_JOB``); its stderr read as it comes."""

    def __init__(self, environment, *arguments, command=None):
        self.marker = f"ACCELGEN_TEST_JOB={environment['ACCELGEN_TEST_JOB']}".encode()
        self.process = subprocess.Popen(command or [sys.executable, "-m", "accelgen.cli", *arguments],
                                        env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.stderr = StderrLines(self.process)

    def processes(self) -> dict[int, str | None]:
        """Each live process of the job (the launcher and its ranks) and its RANK (None for the launcher)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    environment = (entry / "environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if self.marker in environment:
                    ranks = [item[5:].decode() for item in environment if item.startswith(b"RANK=")]
                    found[int(entry.name)] = ranks[0] if ranks else None
        return found

    def rank_pid(self, rank: str) -> int:
        """The pid of a rank, waiting until it has started."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            pids = [pid for pid, its_rank in self.processes().items() if its_rank == rank]
            if pids:
                return pids[0]
            assert self.process.poll() is None, self.text()
            time.sleep(0.01)
        raise AssertionError(f"rank {rank} did not start")

    def wait_until_it_handles(self, number: int) -> None:
        """Wait until the launcher has a handler of its own for the signal ``number`` (its status's SigCgt mask)."""
        deadline = time.monotonic() + START_TIMEOUT
        while not _handles(self.process.pid, number):
            assert self.process.poll() is None and time.monotonic() < deadline, self.text()
            time.sleep(0.01)

    def wait_until_connected_to_its_store(self, pid: int) -> None:
        """Wait until the process ``pid`` (a rank) has a TCP connection to its job's store (MASTER_PORT): it has
        imported its libraries and is joining the process group."""
        port = int(_environment_of(pid)["MASTER_PORT"])
        deadline = time.monotonic() + START_TIMEOUT
        while port not in _remote_ports_of(pid):
            assert self.process.poll() is None and time.monotonic() < deadline, self.text()
            time.sleep(0.01)

    def wait_for_line(self, text: str) -> str:
        return self.stderr.wait_for(text, START_TIMEOUT)

    def end(self) -> int:
        """Wait for the launcher's end; its exit status."""
        return self.process.wait(timeout=END_TIMEOUT)

    def text(self) -> str:
        return self.stderr.text()

    def our_lines(self) -> list[str]:
        return [line for line in self.text().splitlines() if line.startswith("accelgen:")]

    def assert_nothing_left(self):
        deadline = time.monotonic() + 30  # a rank killed by its death signal is gone at once; allow a slow machine
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.processes() == {}

    def kill_all(self):
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _handles(pid: int, number: int) -> bool:
    """Whether the process ``pid`` catches the signal ``number`` (a handler of its own, not the default)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (number - 1) & 1)


def _environment_of(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def _remote_ports_of(pid: int) -> set[int]:
    """The remote ports of the TCP connections the process ``pid`` holds open (its sockets' inodes found in
    /proc/net/tcp and tcp6)."""
    inodes = set()
    for descriptor in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(descriptor)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


@pytest.fixture
def start_job(job_environment):
    """``start_job(*arguments, environment=None)``: a Job; any process left is killed after the test."""
    jobs = []

    def start(*arguments, environment=None, command=None):
        job = Job(environment or job_environment, *arguments, command=command)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.kill_all()
        if job.process.poll() is None:
            job.process.kill()
        job.process.wait()


def run_arguments(folder, *more):
    return ["run", "--device", "cpu", "--world-size", "2", "--model", str(folder), "--prompt", "Hello",
            "--max-new-tokens", "4", *more]


# -- the launcher dies or is interrupted ------------------------------------------------------------------


def test_a_rank_whose_launcher_died_before_it_could_arm_its_death_signal_ends_at_once(cli_environment):
    """The race behind an orphaned rank: its parent is no longer the launcher that named itself."""
    environment = dict(cli_environment, TORCHELASTIC_RUN_ID="orphan", RANK="1", ACCELGEN_LAUNCHER_PID="1")
    result = subprocess.run([sys.executable, "-m", "accelgen.cli", "run", "--device", "cpu", "--prompt", "a"],
                            env=environment, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (1, "", "")


@pytest.mark.parametrize("command", ["run", "shard"])
def test_a_launcher_killed_as_its_ranks_start_leaves_none_running(tiny_model_folder, tmp_path, start_job, command):
    folder = tiny_model_folder("llama")
    arguments = (run_arguments(folder) if command == "run" else
                 ["shard", "--device", "cpu", "--dtype", "float32", "--world-size", "2", "--model", str(folder), "--output",
                  str(tmp_path / "shards")])
    job = start_job(*arguments)
    job.rank_pid("1")  # the ranks' interpreters are starting
    job.process.kill()
    assert job.end() == -signal.SIGKILL
    job.assert_nothing_left()


@pytest.mark.parametrize(
    "signals, when, status, line",
    [
        ([signal.SIGINT], "starting", 130, "accelgen: interrupted"),  # before any rank: the launcher's imports
        ([signal.SIGINT], "ranks", 130, "accelgen: interrupted (SIGINT); all workers stopped"),
        ([signal.SIGINT, signal.SIGINT], "ranks", 130, "accelgen: interrupted (SIGINT); all workers stopped"),
        ([signal.SIGTERM], "ranks", 143, "accelgen: stopped (SIGTERM); all workers stopped"),
        ([signal.SIGHUP], "ranks", 129, "accelgen: stopped (SIGHUP); all workers stopped"),
        ([signal.SIGTERM], "joining", 143, "accelgen: stopped (SIGTERM); all workers stopped"),
    ],
    ids=["sigint-while-starting", "sigint-as-ranks-start", "sigint-twice", "sigterm-as-ranks-start",
         "sighup-as-ranks-start", "sigterm-while-ranks-join"],
)
def test_a_signal_at_any_moment_ends_the_job_in_one_line(tiny_model_folder, start_job, signals, when, status, line):
    job = start_job(*run_arguments(tiny_model_folder("llama"), "--max-new-tokens", "200", "--ignore-eos"))
    if when == "starting":
        job.wait_until_it_handles(signal.SIGTERM)  # its handlers are in place (Python alone catches no SIGTERM)
        job.process.send_signal(signal.SIGSTOP)  # held still while it is checked: no rank has started
        assert [rank for rank in job.processes().values() if rank is not None] == []
    else:
        rank1 = job.rank_pid("1")
        if when == "joining":
            job.wait_until_connected_to_its_store(rank1)  # torch and DeepSpeed imported: it meets the other rank
    for number in signals:
        job.process.send_signal(number)
        time.sleep(0.05)
    job.process.send_signal(signal.SIGCONT)  # (held still while starting) the signals are delivered as it goes on
    assert job.end() == status, job.text()
    assert job.our_lines() == [line]
    assert "Traceback" not in job.text() and "KeyboardInterrupt" not in job.text()
    job.assert_nothing_left()


# -- a rank dies or stops ---------------------------------------------------------------------------------


def test_a_rank_killed_while_it_joins_ends_the_job_in_one_line(tiny_model_folder, start_job):
    """Without restarts (``--max-restarts 0``; tests/test_restarts.py has the job that starts its workers again)."""
    job = start_job(*run_arguments(tiny_model_folder("llama"), "--max-restarts", "0"))
    os.kill(job.rank_pid("1"), signal.SIGKILL)
    assert job.end() == 1
    assert job.our_lines() == ["accelgen: error: worker rank 1 was killed by SIGKILL; the job was stopped."]
    job.assert_nothing_left()


def test_a_stopped_rank_is_named_and_ctrl_c_still_ends_the_job(tiny_model_folder, start_job):
    job = start_job(*run_arguments(tiny_model_folder("llama")))
    rank1 = job.rank_pid("1")
    os.kill(rank1, signal.SIGSTOP)  # the other rank waits for it to join
    notice = job.wait_for_line("is stopped")
    assert notice == (f"accelgen: worker rank 1 (pid {rank1}) is stopped and the job waits for it: resume it with "
                      f"'kill -CONT {rank1}', or end the job with Ctrl-C ('kill -INT {job.process.pid}').\n")
    job.process.send_signal(signal.SIGINT)
    assert job.end() == 130
    assert job.our_lines() == [notice.strip(), "accelgen: interrupted (SIGINT); all workers stopped"]
    job.assert_nothing_left()


# -- what the ranks share: a port, HOME, the extension's build folder -------------------------------------


def test_a_job_on_the_port_of_a_running_job_is_one_line_and_the_running_job_goes_on(tiny_model_folder, start_job,
                                                                                      job_environment):
    """The second job starts once the first one's ranks run (its agent listens on the port by then), and the first
    one's launcher is held stopped meanwhile (its socket stays open): no moment decides the outcome. Two jobs whose
    ports meet in the instant between the check and the agent's listening: ``test_tensor_parallel``'s
    picked-port test."""
    port = free_port()
    running = start_job(*run_arguments(tiny_model_folder("llama"), "--master-port", str(port)))
    running.rank_pid("1")
    running.process.send_signal(signal.SIGSTOP)
    try:
        second = start_job(*run_arguments(tiny_model_folder("llama"), "--master-port", str(port)),
                           environment=dict(job_environment, ACCELGEN_TEST_JOB=job_environment["ACCELGEN_TEST_JOB"] + "b"))
        assert second.end() == 2, second.text()
    finally:
        running.process.send_signal(signal.SIGCONT)
    assert second.our_lines() == [f"accelgen: error: Cannot use --master-port {port} on 127.0.0.1: Address already in "
                                  f"use; pass a free port."]
    assert "Traceback" not in second.text()
    assert running.end() == 0, running.text()
    for job in (running, second):
        job.assert_nothing_left()


def test_an_unwritable_home_is_one_line_naming_the_folder_and_the_fix(tiny_model_folder, tmp_path, start_job,
                                                                      job_environment):
    """HOME where nothing can be created (below a file: even root cannot write there, unlike a chmod)."""
    (tmp_path / "a-file").write_text("")
    home = tmp_path / "a-file" / "home"
    environment = {name: value for name, value in job_environment.items()
                   if name not in ("TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME")}
    job = start_job(*run_arguments(tiny_model_folder("llama")), environment=dict(environment, HOME=str(home)))
    assert job.end() == 2, job.text()
    folder = home / ".cache" / "torch_extensions"
    [line] = job.our_lines()
    assert line.startswith(f"accelgen: error: Cannot write {folder}/")
    assert line.endswith(f": Not a directory: set TORCH_EXTENSIONS_DIR to a writable folder (by default under HOME, "
                         f"{home}, which is not writable here).")
    assert "Traceback" not in job.text()
    job.assert_nothing_left()


def extensions_folder_with_a_lock(tmp_path, built_extension: Path) -> Path:
    """A TORCH_EXTENSIONS_DIR holding this install's compiled extension (no compile in the test's job) and a lock
    file in its build folder."""
    extensions = extensions_folder_with_the_kernels(tmp_path / "extensions")
    install_folder = built_extension.relative_to(built_extension.parent.parent)  # accelgen-deepspeed-<key>/...
    shutil.copytree(built_extension, extensions / install_folder, ignore=shutil.ignore_patterns("lock"))
    (extensions / install_folder / "lock").touch()
    return extensions


def test_a_stale_build_lock_is_not_blamed_on_a_shell_working_in_its_folder(tiny_model_folder, tmp_path, start_job,
                                                                           job_environment, built_extension):
    extensions = extensions_folder_with_a_lock(tmp_path, built_extension)
    lock = next(extensions.glob("*/*/lock"))
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # left an hour ago by a stopped compile
    shell = subprocess.Popen(["sleep", "600"], cwd=lock.parent)  # someone's shell, not a compile
    try:
        job = start_job(*run_arguments(tiny_model_folder("llama")),
                        environment=dict(job_environment, TORCH_EXTENSIONS_DIR=str(extensions)))
        assert job.end() == 0, job.text()
    finally:
        shell.kill()
        shell.wait()
    # the shell is not taken for a compile (nor its parent, this test's process, for the one that started it); a
    # wait for another build (the CPU kernels', in a run-wide shared folder) is not this test's business
    blamed = [line for line in job.our_lines()
              if "to finish compiling DeepSpeed's CPU all-reduce extension" in line or f"process {shell.pid} " in line
              or f"process {os.getpid()} " in line]
    assert blamed == []
    assert f"accelgen: warning: removed {lock}, left by a compile of DeepSpeed's CPU all-reduce extension" in job.text()
    job.assert_nothing_left()


def test_a_build_lock_dated_in_the_future_is_aged_by_watching_it_and_the_wait_says_so(tmp_path, monkeypatch,
                                                                                      capsys):
    from accelgen_cpu import extension_lock

    monkeypatch.setattr(extension_lock, "SAY_AFTER_SECONDS", 1)
    monkeypatch.setattr(extension_lock, "STALE_AFTER_SECONDS", 3)
    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    lock = folder / "lock"
    lock.touch()
    os.utime(lock, (time.time() + 86400, time.time() + 86400))  # a clock moved back since it was written
    with pytest.warns(extension_lock.AccelgenWarning, match="removed .*lock, left by a compile"):
        extension_lock.wait_for_build_lock(str(lock), str(folder))
    assert not lock.exists()
    assert capsys.readouterr().err.startswith(f"accelgen: waiting for {lock}: no process is compiling DeepSpeed's "
                                              f"CPU all-reduce extension; the lock goes in ")


def start_a_compile_in(folder: Path, programs: Path) -> subprocess.Popen:
    """A process that looks to the lock check like a compile at work: a build tool named ``ninja`` (``sleep``
    under that name) whose working directory is the build folder, started by this process as torch starts ninja
    from the process that took the lock."""
    ninja = programs / "ninja"
    shutil.copy(shutil.which("sleep"), ninja)
    return subprocess.Popen([str(ninja), "600"], cwd=folder)


class StderrThatRemovesTheLock:
    """Standard error that keeps each line written, and removes ``lock`` (the compile is over) once a line says
    the wait goes on: a wait long enough to repeat itself, without a timed test."""

    def __init__(self, lock: Path):
        self.lock, self.text = lock, ""

    def write(self, text: str) -> int:
        self.text += text
        if "still waiting" in text:
            self.lock.unlink(missing_ok=True)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_wait_on_a_compile_names_the_process_holding_the_lock_and_repeats_with_the_time_so_far(tmp_path,
                                                                                                 monkeypatch):
    """Before: "waiting for process N, compiling ... (once per machine; a minute or two)", said once, however long
    the wait (a user waited 442 s under it)."""
    from accelgen_cpu import extension_lock

    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    lock = folder / "lock"
    lock.touch()
    stderr = StderrThatRemovesTheLock(lock)
    compile_at_work = start_a_compile_in(folder, tmp_path)
    try:
        monkeypatch.setattr(sys, "stderr", stderr)
        extension_lock.wait_for_build_lock(str(lock), str(folder), repeat_seconds=1)
    finally:
        monkeypatch.undo()
        compile_at_work.kill()
        compile_at_work.wait()
    first, again = stderr.text.splitlines()
    holder = rf"process {os.getpid()} \(\S*python\S* .+\)"  # the process that started the compile: this one
    compiling = rf"to finish compiling DeepSpeed's CPU all-reduce extension in {re.escape(str(folder))}"
    assert re.fullmatch(rf"accelgen: waiting for {holder} {compiling} \(it holds the lock there; Ctrl-C stops this "
                        rf"job\)", first), first
    assert re.fullmatch(rf"accelgen: still waiting for {holder} {compiling} \(\d+ s so far\)", again), again
    assert "minute" not in stderr.text


def test_a_job_waiting_on_a_compile_says_for_what_and_ctrl_c_ends_it(tiny_model_folder, tmp_path, start_job,
                                                                     job_environment, built_extension):
    extensions = extensions_folder_with_a_lock(tmp_path, built_extension)
    lock = next(extensions.glob("*/*/lock"))
    compile_at_work = start_a_compile_in(lock.parent, tmp_path)
    try:
        job = start_job(*run_arguments(tiny_model_folder("llama")),
                        environment=dict(job_environment, TORCH_EXTENSIONS_DIR=str(extensions)))
        line = job.wait_for_line("waiting for")
        assert line.startswith(f"accelgen: waiting for process {os.getpid()} (")
        assert line.endswith(f" to finish compiling DeepSpeed's CPU all-reduce extension in {lock.parent} (it holds the "
                             f"lock there; Ctrl-C stops this job)\n")
        job.process.send_signal(signal.SIGINT)
        assert job.end() == 130, job.text()
    finally:
        compile_at_work.kill()
        compile_at_work.wait()
    assert job.our_lines() == [line.strip(), "accelgen: interrupted (SIGINT); all workers stopped"]
    assert "Traceback" not in job.text()
    job.assert_nothing_left()


# -- torchrun started by hand -----------------------------------------------------------------------------


def test_torchrun_by_hand_with_a_damaged_model_is_one_line_per_rank(tiny_model_folder, tmp_path, start_job):
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_model_folder("llama"), damaged)
    weights = damaged / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    job = start_job(command=[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             str(free_port()), "-m", "accelgen.cli", *run_arguments(damaged)[:3],
                             *run_arguments(damaged)[5:]])
    assert job.end() == 1  # torchrun's own status for a failed rank
    lines = job.our_lines()
    # one line per rank at most: the first rank to fail makes torchrun stop the other, which may not get to say it
    ranks = [line.split("]")[0] for line in lines]
    assert ranks and len(set(ranks)) == len(ranks)
    assert set(ranks) <= {"accelgen: error: [rank 0", "accelgen: error: [rank 1"}
    assert all("has a damaged weight file: model.safetensors: truncated" in line for line in lines)
    # torchrun's own report follows, quoting our line; no frame of ours anywhere
    assert not [line for line in job.text().splitlines() if "/core/" in line or "/plugins/" in line]
    job.assert_nothing_left()
