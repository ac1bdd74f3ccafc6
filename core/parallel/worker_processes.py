"""The ranks of a launched job as processes: a rank ties its life to its launcher's from its first
instruction and ends without tearing its interpreter down; the launcher finds its ranks among its children
(a stopped one, one left running) through ``/proc``.

This module imports only the standard library: every rank imports it before anything heavy
(``accelgen.cli.__main__``), so that a launcher killed while its ranks start leaves none of them running.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, NoReturn

#: Set by torch's elastic launcher in every rank it starts.
WORKER_VARIABLE = "TORCHELASTIC_RUN_ID"
#: Set by our launcher, for the ranks it starts, to its process id: a rank whose parent is another process
#: was orphaned before it could arrange to die with its launcher (:func:`start_worker`).
LAUNCHER_VARIABLE = "ACCELGEN_LAUNCHER_PID"
#: How long a rank stays stopped (SIGSTOP, SIGTSTP) before the launcher says so: the job waits for it.
STOPPED_NOTICE_SECONDS = 3.0


#: Set by torch's elastic agent in every rank: how many times it has started the job's workers again.
RESTART_VARIABLE = "TORCHELASTIC_RESTART_COUNT"


def restarts_so_far() -> int:
    """How many times the workers of this job were started again after one failed (0 outside a launched job)."""
    return int(os.environ.get(RESTART_VARIABLE) or 0)


#: Set by our launcher, for the ranks it starts, to the time it first started them (seconds since the epoch).
JOB_STARTED_VARIABLE = "ACCELGEN_JOB_STARTED"


def written_by_this_job(path: str | None) -> bool:
    """Whether this launched job's workers wrote ``path`` (changed since the job started them first): a restarted
    worker resumes such an output, and replaces one from before the job when the command says --overwrite."""
    started = os.environ.get(JOB_STARTED_VARIABLE)
    if started is None or path is None:
        return False
    try:
        return os.path.getmtime(path) >= float(started)
    except OSError:
        return False


#: What a collective's error says when another rank of the job is gone (gloo's words; NCCL's): this rank's
#: failure is that one's consequence, which the launcher reports.
PEER_LOST_SIGNS = ("Connection reset by peer", "Connection closed by peer", "remote process exited")


def lost_a_peer(error: BaseException | str) -> bool:
    """Whether ``error`` (an exception, or the message a failed rank recorded for its launcher) is a collective
    failing because another rank of the job went away."""
    return any(sign in str(error) for sign in PEER_LOST_SIGNS)


def running_as_worker() -> bool:
    """True inside a process started by torchrun / torch's elastic agent (ours or the user's)."""
    return WORKER_VARIABLE in os.environ or "RANK" in os.environ


def start_worker() -> None:
    """The first thing a launched rank does: end with its launcher, and let SIGINT and SIGTERM end it at once.

    Python would only raise KeyboardInterrupt once the running C++ call returns, and a rank waiting in an
    all-reduce for a peer that has already stopped never returns: the launcher then waited out its whole grace
    period before killing it. Nothing is lost by stopping at once: rank 0 writes each completed row in one
    write, and a torn last line is cut on resume."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # a library's log line to a standard output whose reader went away (``accelgen run ... | head``) is dropped,
    # not reported with a "--- Logging error ---" traceback
    logging.raiseExceptions = False
    _end_with_the_launcher()


def _end_with_the_launcher() -> None:
    """Have Linux kill this rank when the launcher that started it dies (SIGKILL, a crash), which no signal
    handler of the launcher's can forward: the rank would otherwise wait in its next collective for ever.

    The launcher may die before the signal is armed (the rank's interpreter is still starting): the rank then
    has another parent already, and ends here. Our launcher names itself (:data:`LAUNCHER_VARIABLE`); under
    torchrun started by hand, the parent seen just before arming is all there is to go by."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    launcher = int(os.environ.get(LAUNCHER_VARIABLE) or os.getppid())
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher:
        os._exit(1)  # the launcher is gone: nobody waits for this rank


def end_worker_process(status: int) -> NoReturn:
    """End a launched worker, its work done, without tearing the interpreter down.

    DeepSpeed's layers keep torch's gloo process groups alive until the interpreter finalizes, and a gloo
    worker thread may then still be releasing the tensors of a finished collective: it cannot take the GIL
    of a finalizing interpreter, and the process aborts ("terminate called without an active exception",
    SIGABRT; pytorch/pytorch#190489). Python's exit handlers run first
    and the output is flushed, so nothing the worker wrote or registered is lost."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# -- the launcher's side ----------------------------------------------------------------------------------


def launched_workers() -> dict[int, dict[str, str]]:
    """This process's live ranks: the children it started as our launcher (:data:`LAUNCHER_VARIABLE` names
    it in their environment), each pid with its environment (empty where /proc cannot be read)."""
    launcher = str(os.getpid())
    workers = {}
    for pid in _children():
        environment = _environment_of(pid)
        if environment.get(LAUNCHER_VARIABLE) == launcher:
            workers[pid] = environment
    return workers


def stop_leftover_workers() -> None:
    """Kill (SIGKILL) and reap any rank still running once the job is over, however it ended: torch's agent
    forgets a rank it started when a signal interrupts it while it starts the others."""
    for pid in launched_workers():
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            continue


class StoppedWorkerWatch:
    """While a job runs, says once (``say(line)``) when one of its ranks has been stopped for
    :data:`STOPPED_NOTICE_SECONDS`: the other ranks then wait for it in their next collective, and the job
    would freeze without a word. Use as a context manager around the job."""

    def __init__(self, say: Callable[[str], None], interval: float = 0.5) -> None:
        self.say = say
        self.interval = interval
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="accelgen-stopped-worker-watch", daemon=True)

    def __enter__(self) -> StoppedWorkerWatch:
        self.thread.start()
        return self

    def __exit__(self, *exception) -> None:
        self.done.set()
        self.thread.join()

    def _watch(self) -> None:
        stopped_since: dict[int, float] = {}
        told: set[int] = set()
        while not self.done.wait(self.interval):
            now = time.monotonic()
            for pid, environment in launched_workers().items():
                if _state_of(pid) != "T":
                    stopped_since.pop(pid, None)
                    told.discard(pid)  # resumed: a later stop is told again
                    continue
                stopped_since.setdefault(pid, now)
                if pid not in told and now - stopped_since[pid] >= STOPPED_NOTICE_SECONDS:
                    told.add(pid)
                    self.say(f"worker rank {environment.get('RANK', '?')} (pid {pid}) is stopped and the job waits for "
                             f"it: resume it with 'kill -CONT {pid}', or end the job with Ctrl-C "
                             f"('kill -INT {os.getpid()}').")


def _children() -> list[int]:
    """Process ids whose parent is this process (Linux /proc; none elsewhere)."""
    me = os.getpid()
    children = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields and int(fields[1]) == me:
                children.append(int(entry))
    return children


def _state_of(pid: int) -> str | None:
    """A process's state letter (R, S, D, T stopped, t traced, Z zombie...), None when it is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...); empty when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read().decode(errors="replace")
    except OSError:
        return []
    return text[text.rfind(")") + 2:].split()  # the name, in parentheses, may hold spaces and parentheses


def _environment_of(pid: int) -> dict[str, str]:
    """The environment a process was started with (empty when unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            entries = environ.read().decode(errors="replace").split("\0")
    except OSError:
        return {}
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)
