"""Starting the worker processes of a tensor-parallel job, and how a failing one ends the job.

``accelgen run --world-size N`` calls :func:`launch_job`, which checks what can be checked before any
process starts, then runs ``python -m accelgen.cli run ...`` N times (``N / nnodes`` on this node) with the
device's own launcher or under ``torch.distributed.run``: the launcher's agent sets RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT, watches the workers, and stops all of them when one fails or
when it is interrupted; with ``--max-restarts N`` it then starts them again, up to N times, and they resume the
output (each restart said in one line; a failure on the user's mistake is not retried). The nodes of a multi-node
job meet before the agent starts (``accelgen.parallel.node_meeting``: a wait that speaks). Workers report a failure
through the error file the agent gives them (:func:`record_worker_failure`), so the launcher can print it as one
line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Iterator, Sequence

from accelgen.common.errors import CLOSED_OUTPUT_STATUS, EVERY_ROW_FAILED_STATUS, UsageError
from accelgen.common.output_files import replace_whole
from accelgen.common.settings import DEFAULT_NODE_WAIT, LaunchPlan
from accelgen.parallel.node_meeting import NodeMeeting, NodesMissing
from accelgen.parallel.worker_processes import (
    JOB_STARTED_VARIABLE,
    LAUNCHER_VARIABLE,
    StoppedWorkerWatch,
    lost_a_peer,
    stop_leftover_workers,
)
from accelgen.parallel.worker_processes import running_as_worker as running_as_worker  # the command line asks here

if TYPE_CHECKING:
    from accelgen.plugin.contract import Accelerator

#: Seconds torch's launcher gives an interrupted worker before it kills it (its default: 30).
SHUTDOWN_GRACE_SECONDS = 3
#: Ports picked, one after another, for a one-node job whose picked port another process took first.
PORT_PICKS = 5


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def check_port_free(address: str, port: int) -> None:
    """Raise UsageError when this machine cannot listen on ``address:port`` (the rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, port))
        except OSError as error:
            raise _port_taken(address, port, error.strerror or str(error)) from None


def _port_taken(address: str, port: int, why: str) -> UsageError:
    return UsageError(f"Cannot use --master-port {port} on {address}: {why}; pass a free port.")


def plan_launch(world_size: int, nnodes: int, node_rank: int, master_addr: str, master_port: int | None,
                data_parallel: int = 1, max_restarts: int = 0, node_wait: int = DEFAULT_NODE_WAIT) -> LaunchPlan:
    """The checked plan of a job of ``world_size`` ranks over ``nnodes`` machines, this one ``node_rank``, in
    ``data_parallel`` replicas, its workers started again up to ``max_restarts`` times after one fails, each node
    waiting ``node_wait`` seconds for the others (each number already in its range: ``accelgen.common.value_ranges``)."""
    if world_size % nnodes:
        raise UsageError(f"--world-size {world_size} must be a multiple of --nnodes {nnodes}: each node runs as many ranks.")
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank must be between 0 and {nnodes - 1} (got {node_rank}).")
    check_data_parallel(world_size, data_parallel, world_size // nnodes)
    port = master_port or (free_port(master_addr) if nnodes == 1 else 29500)
    if node_rank == 0:
        check_port_free(master_addr, port)
    return LaunchPlan(world_size, nnodes, node_rank, master_addr, port, max_restarts, node_wait,
                      port_given=master_port is not None or nnodes > 1)


def check_data_parallel(world_size: int, data_parallel: int, ranks_per_node: int) -> None:
    """Raise UsageError unless ``data_parallel`` replicas split a job of ``world_size`` ranks evenly, each
    replica on one node (its all-reduces stay on the node's links; a replica across nodes would make every
    layer wait for the network)."""
    if world_size % data_parallel:
        raise UsageError(f"--data-parallel {data_parallel} must divide --world-size {world_size} (each replica runs "
                         f"on world-size / data-parallel ranks): pass a --world-size that it divides.")
    replica_size = world_size // data_parallel
    if data_parallel > 1 and ranks_per_node % replica_size:
        raise UsageError(f"--data-parallel {data_parallel} makes replicas of {replica_size} ranks, which would span "
                         f"nodes of {ranks_per_node} ranks each: choose --data-parallel so that a replica's ranks "
                         f"({world_size} / data-parallel) divide the ranks of a node.")


@dataclasses.dataclass(frozen=True)
class JobEnd:
    """How a launched job ended: its exit status, and when it failed or was stopped, one line saying how."""

    status: int
    line: str | None = None


def check_node_devices(accelerator: Accelerator, plan: LaunchPlan) -> None:
    """Raise UsageError when this node has fewer devices than the job's ranks on it need (a device that takes one
    process per device)."""
    if accelerator.one_process_per_device and plan.processes_per_node > accelerator.device_count():
        raise UsageError(
            f"--world-size {plan.world_size} needs {plan.processes_per_node} {accelerator.name} devices on this "
            f"node, which has {accelerator.device_count()}: lower --world-size or add nodes with --nnodes."
        )


def launch_job(accelerator: Accelerator, plan: LaunchPlan, worker_argv: Sequence[str]) -> JobEnd:
    """Start this node's ranks, each running ``accelgen <worker_argv>``; return how the job ended. (What the job
    needs of the node and of the model is checked by the caller, before: :func:`check_node_devices`,
    ``accelgen.session.request.Request.check_world_size``.)"""
    for name, value in accelerator.worker_environment(plan).items():
        os.environ.setdefault(name, value)  # the ranks inherit it; a value the user set wins
    try:
        return launch_workers(worker_argv, plan, accelerator.launch_command(list(worker_argv), plan))
    finally:
        accelerator.clean_up_after_workers(plan)


def launch_workers(worker_argv: Sequence[str], plan: LaunchPlan, launch_command: list[str] | None) -> JobEnd:
    """Run ``accelgen <worker_argv>`` as this node's workers, with the accelerator's own launcher
    command when it has one, else with torch's."""
    if launch_command is not None:
        return run_launch_command(launch_command, plan)
    return launch_with_torchrun(worker_argv, plan)


def run_launch_command(command: list[str], plan: LaunchPlan) -> JobEnd:
    """Run an accelerator's launcher (e.g. DeepSpeed's) in the foreground; stop it on Ctrl-C.

    Its ranks print their own one-line errors (no torch error file exists outside torchrun)."""
    if shutil.which(command[0]) is None:
        raise UsageError(f"The launcher {command[0]!r} this device needs is not installed (not on PATH).")
    environment = dict(os.environ, MASTER_ADDR=plan.master_addr, MASTER_PORT=str(plan.master_port))
    process = subprocess.Popen(command, env=environment, start_new_session=True)
    try:
        status = process.wait()
    except KeyboardInterrupt:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        return JobEnd(130, "interrupted (SIGINT); all workers stopped")
    if status in (0, EVERY_ROW_FAILED_STATUS):  # rank 0 said why every row failed
        return JobEnd(status)
    return JobEnd(2 if status == 2 else 1, f"error: the job's launcher ({command[0]}) exited with status {status}; "
                                           f"the failing rank's error is above.")


def launch_with_torchrun(worker_argv: Sequence[str], plan: LaunchPlan) -> JobEnd:
    """Run this node's workers under ``torch.distributed.run``; one line for a failed or interrupted job.

    Whatever ends the job (its end, a failing rank, a signal, even a signal while the ranks start), no rank
    outlives it: the ranks die with this process (``accelgen.parallel.worker_processes``), and any rank torch's
    agent left running is killed before this returns. A port picked here (no ``--master-port``) that another
    process takes before the agent listens on it is picked again; a port the user named is theirs to change."""
    from torch.distributed import DistNetworkError

    picks = 1
    while True:
        try:
            return _run_agent(worker_argv, plan)
        except DistNetworkError as error:
            if "EADDRINUSE" not in str(error):
                raise
            if plan.port_given or picks == PORT_PICKS:
                raise _port_taken(plan.master_addr, plan.master_port,
                                  "another job took it as this one started") from None
            plan, picks = dataclasses.replace(plan, master_port=free_port(plan.master_addr)), picks + 1


def _run_agent(worker_argv: Sequence[str], plan: LaunchPlan) -> JobEnd:
    """One run of torch's agent over this node's workers (``launch_with_torchrun``)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    launcher_arguments = torchrun.parse_args([
        f"--nproc-per-node={plan.processes_per_node}",
        f"--nnodes={plan.nnodes}",
        f"--node-rank={plan.node_rank}",
        f"--master-addr={plan.master_addr}",
        f"--master-port={plan.master_port}",
        f"--max-restarts={plan.max_restarts}",
        "--monitor-interval=0.1",  # notice a failed worker within a tenth of a second
        "--signals-to-handle=SIGQUIT",  # and the JOB_ENDING_SIGNALS, handled here
        "--module",
        "accelgen.cli",
        *worker_argv,
    ])
    # a worker that did not stop on the launcher's signal is killed (with its process group) after this
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_GRACE_SECONDS))
    started = str(time.time())  # an output changed since was written by this job's workers: a restart resumes it
    signals = _SignalsEndTheJob(SignalException)
    restarts = _RestartsSaid(plan.max_restarts)
    meeting = NodeMeeting(plan, _say)
    try:
        with signals, _environment(LAUNCHER_VARIABLE, str(os.getpid())), _environment(JOB_STARTED_VARIABLE, started), \
                StoppedWorkerWatch(_say), _quiet_agent(), restarts, meeting:
            torchrun.run(launcher_arguments)
    except NodesMissing as missing:
        return JobEnd(missing.status, f"error: {missing}")
    except ChildFailedError as failure:
        rank, process_failure = _first_cause(failure.failures)
        if process_failure.exitcode in (CLOSED_OUTPUT_STATUS, EVERY_ROW_FAILED_STATUS):  # rank 0 said why, or
            return JobEnd(process_failure.exitcode)  # saw its reader go: nothing to add
        return JobEnd(2 if process_failure.exitcode == 2 else 1,
                      f"error: {_failure_line(rank, process_failure)}{restarts.after()}")
    except SignalException as interrupt:
        received = signals.received or interrupt.sigval
        ended = "interrupted" if received == signal.SIGINT else "stopped"
        if not meeting.met:
            return JobEnd(128 + received, f"{ended} ({received.name}) while waiting for {meeting.waiting_for()}")
        return JobEnd(128 + received, f"{ended} ({received.name}); all workers stopped")
    return JobEnd(0)


class _RestartsSaid:
    """Around a job run by torch's agent with ``max_restarts``: each time a worker fails and the agent is about to
    start the workers again, one line says which rank, why, and which restart it is; a worker that failed on the
    user's mistake (exit status 2: the same command would fail the same way) or whose output's reader went away
    ends the job at once instead. The agent is told so the way it tells itself (no restarts left)."""

    def __init__(self, max_restarts: int):
        self.max_restarts, self.done = max_restarts, 0
        self._original = None

    def __enter__(self) -> "_RestartsSaid":
        if self.max_restarts:
            from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

            self._agent_class, self._original = LocalElasticAgent, LocalElasticAgent._monitor_workers
            said = self

            def monitor_workers(agent, worker_group):
                result = said._original(agent, worker_group)
                if result.is_failed() and agent._remaining_restarts > 0:
                    said._decide(agent, result.failures)
                return result

            LocalElasticAgent._monitor_workers = monitor_workers
        return self

    def _decide(self, agent, failures: dict) -> None:
        rank, failure = _first_cause(failures)
        if failure.exitcode in (2, CLOSED_OUTPUT_STATUS, EVERY_ROW_FAILED_STATUS):
            agent._remaining_restarts = 0  # a user's mistake, or a job done (its rows all error rows), is not tried again
            return
        self.done += 1
        _say(f"{_failure_line(rank, failure).removesuffix('; the job was stopped.').rstrip('.')}; starting the "
             f"workers again (restart {self.done} of {self.max_restarts}): they resume from the output.")

    def after(self) -> str:
        """What the job's last line adds when restarts were made."""
        return f" (after {self.done} restart{'' if self.done == 1 else 's'})" if self.done else ""

    def __exit__(self, *exception) -> None:
        if self._original is not None:
            self._agent_class._monitor_workers = self._original


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """Keep torch's agent's log lines (its OMP_NUM_THREADS advice, each signal it sends, a failed rank's exit
    code) off the terminal while it runs the job: how the job ended is our one line."""
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run"))]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _say(line: str) -> None:
    print(f"accelgen: {line}", file=sys.stderr, flush=True)


#: The signals that end a job. We handle them, not torch's agent (``--signals-to-handle``), to ask the agent to
#: stop the ranks with SIGTERM whichever came: it ends a rank at once whatever it is doing, even while its
#: interpreter starts, where the SIGINT the agent would forward shows a KeyboardInterrupt's traceback.
JOB_ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _SignalsEndTheJob:
    """Around a job run by torch's agent: SIGINT, SIGTERM and SIGHUP raise ``signal_exception`` (torch's
    SignalException, which makes the agent stop the ranks) from the start, where SIGTERM would otherwise kill
    this process at once; :attr:`received` is the signal that came. Once the job is over the signals are
    ignored while leftover ranks are killed (a second Ctrl-C must not cut that short), then the handlers are
    as they were, unless a signal ended the job: this process then only says so and exits, and another
    Ctrl-C meanwhile would show a KeyboardInterrupt's traceback (or kill it) in the middle of that."""

    def __init__(self, signal_exception: type[Exception]) -> None:
        self.signal_exception = signal_exception
        self.received: signal.Signals | None = None
        self.previous: dict[int, object] = {}

    def __enter__(self) -> _SignalsEndTheJob:
        if threading.current_thread() is threading.main_thread():  # only the main thread handles signals
            self.previous = {number: signal.getsignal(number) for number in JOB_ENDING_SIGNALS}
            for number in JOB_ENDING_SIGNALS:
                signal.signal(number, self._end_the_job)
        return self

    def _end_the_job(self, signal_number: int, frame) -> None:
        self.received = self.received or signal.Signals(signal_number)
        raise self.signal_exception(f"Process {os.getpid()} got signal: {signal_number}", signal.SIGTERM)

    def __exit__(self, *exception) -> None:
        for number in self.previous:
            signal.signal(number, signal.SIG_IGN)
        stop_leftover_workers()
        if self.received is None:
            for number, handler in self.previous.items():
                signal.signal(number, handler)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block (which the ranks inherit), as it was after."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _first_cause(failures: dict) -> tuple[int, object]:
    """Of a job's failed ranks (rank: torch's ProcessFailure), the one whose failure the job's line names: not a
    rank whose collective failed because another had gone (its recorded error says so, as the rank itself told by
    :func:`lost_a_peer` when it kept quiet), nor one the agent stopped (SIGTERM) because another failed, then the
    first to fail (by the second: two often fail in the same one), then a killed rank before one that failed on
    losing it."""
    def consequence(process_failure) -> bool:
        message = _message_of(process_failure)
        return not message.startswith("UsageError: ") and lost_a_peer(message)

    def stopped_by_the_agent(process_failure) -> bool:  # torch's agent sends SIGTERM to the others when one fails
        return process_failure.exitcode == -signal.SIGTERM

    return min(failures.items(), key=lambda item: (consequence(item[1]), stopped_by_the_agent(item[1]),
                                                   item[1].timestamp, item[1].exitcode != -signal.SIGKILL,
                                                   item[1].exitcode >= 0))


def _message_of(process_failure) -> str:
    """The one-line message a failed rank recorded in its error file ("" when it recorded none)."""
    message = process_failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return message


def _failure_line(rank: int, process_failure) -> str:
    message = _message_of(process_failure)
    if message.startswith("UsageError: "):
        return message.removeprefix("UsageError: ")
    if process_failure.exitcode < 0:
        return f"worker rank {rank} was killed by {process_failure.signal_name()}; the job was stopped."
    if not message or process_failure.error_file == "<N/A>":
        return f"worker rank {rank} exited with status {process_failure.exitcode}; its output is above."
    return f"worker rank {rank} failed: {message}"


def record_worker_failure(error: BaseException) -> bool:
    """Hand a worker's error to torch's launcher through the error file its agent reads: a user's mistake as
    its one line, which the agent's report then shows in place of a traceback; any other error with its
    traceback, in the form torch's ``ErrorHandler`` writes.

    The file appears whole or not at all: a SIGTERM landing while it was written (the agent stops the other
    ranks when one fails) left half a JSON document, on which the agent itself failed with a traceback.

    Returns True when our launcher will print the error; False when the caller must: this process has no error
    file (started by another launcher), or torchrun started by hand runs it, whose report holds the line
    among its own."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return False
    timestamp = str(int(time.time()))
    if isinstance(error, UsageError):
        record = {"message": f"UsageError: {error}", "timestamp": timestamp}
    else:
        import traceback

        record = {"message": {"message": f"{type(error).__name__}: {error}",
                              "extraInfo": {"py_callstack": "".join(traceback.format_exception(error)),
                                            "timestamp": timestamp}}}
    text = json.dumps(record)

    def write(path: str) -> None:
        with open(path, "w") as file:
            file.write(text)

    replace_whole(error_file, write)
    return LAUNCHER_VARIABLE in os.environ
