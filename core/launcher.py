"""Starting the worker processes of a tensor-parallel job with torch's elastic launcher (torchrun).

``accelgen run --world-size N`` calls :func:`launch_workers`, which runs ``python -m accelgen.cli run
...`` N times (``N / nnodes`` on this node) under ``torch.distributed.run``: the launcher's agent sets
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, watches the workers, and stops all of
them when one fails or when it is interrupted. Workers report a failure through the error file the
agent gives them (:func:`record_worker_failure`), so the launcher can print it as one line.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Sequence

from accelgen.errors import UsageError

#: Set by torch's elastic launcher in every worker it starts.
WORKER_VARIABLE = "TORCHELASTIC_RUN_ID"


def running_as_worker() -> bool:
    """True inside a process started by torchrun / torch's elastic agent (ours or the user's)."""
    return WORKER_VARIABLE in os.environ or "RANK" in os.environ


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
            raise UsageError(
                f"Cannot use --master-port {port} on {address}: {error.strerror or error}; pass a free port."
            ) from None


def launch_workers(
    worker_argv: Sequence[str], processes_per_node: int, nnodes: int, node_rank: int, master_addr: str, master_port: int
) -> int:
    """Run ``accelgen <worker_argv>`` as this node's workers; return the job's exit status."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    launcher_arguments = torchrun.parse_args([
        f"--nproc-per-node={processes_per_node}",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        "--max-restarts=0",
        "--monitor-interval=0.1",  # notice a failed worker within a tenth of a second
        "--module",
        "accelgen.cli",
        *worker_argv,
    ])
    try:
        torchrun.run(launcher_arguments)
    except ChildFailedError as failure:
        rank, process_failure = failure.get_first_failure()
        print(f"accelgen: error: {_failure_line(rank, process_failure)}", file=sys.stderr)
        return 2 if process_failure.exitcode == 2 else 1
    except SignalException as interrupt:
        print(f"accelgen: interrupted ({interrupt.sigval.name}); all workers stopped", file=sys.stderr)
        return 130
    return 0


def _failure_line(rank: int, process_failure) -> str:
    message = process_failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if message.startswith("UsageError: "):
        return message.removeprefix("UsageError: ")
    if process_failure.exitcode < 0:
        return f"worker rank {rank} was killed by {process_failure.signal_name()}; the job was stopped."
    if not message or process_failure.error_file == "<N/A>":
        return f"worker rank {rank} exited with status {process_failure.exitcode}; its output is above."
    return f"worker rank {rank} failed: {message}"


def record_worker_failure(error: BaseException) -> bool:
    """Hand a worker's error to torch's launcher through the error file its agent reads.

    Returns False when this process has no such file (started by another launcher)."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return False
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(error)
    return True
