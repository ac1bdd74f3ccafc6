"""The other ranks of a tensor-parallel replica on a Ray cluster (``--world-size N`` with ``--ray``).

A replica is one Ray actor, given all of its ranks' resources on one node (Ray makes the node's devices it got visible
to it: ``CUDA_VISIBLE_DEVICES``, ``HABANA_VISIBLE_MODULES``). The actor is rank 0; it starts ranks 1 to N - 1 as
processes of its own on the node (``python -m accelgen.ray.replica_ranks``), which join its process group through
a store rank 0 hosts, as the ranks of ``accelgen run --world-size N`` do. Each call's rows reach them from rank 0 by
a broadcast, and every rank completes them (the model's collectives keep them in step); rank 0 alone answers.

A rank that ends takes the replica with it: a watchdog in rank 0 ends the actor's process, so the driver sees the
replica lost and starts it again, instead of rank 0 waiting in a collective for a rank that is gone. The ranks end
with rank 0 (a parent-death signal), so a replica killed or lost leaves no rank behind.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

import torch

from accelgen.common.settings import LaunchPlan, World

#: The call that asks the ranks for their figures (every rank of the replica gathers them).
REPORT = "report"
#: Seconds between the watchdog's looks at the ranks.
WATCH_SECONDS = 0.5
#: Seconds a replica whose collective failed waits to see one of its ranks end (the rank's end can be seen after
#: the collective broke) before it takes the failure as the job's.
RANK_END_SECONDS = 5.0
#: Linux's prctl option that sends a signal to a process when its parent ends.
_PR_SET_PDEATHSIG = 1


class ReplicaRanks:
    """Ranks 1 to ``size`` - 1 of the replica whose rank 0 is this process, started on this node."""

    def __init__(self, recipe, accelerator, size: int):
        self.size = size
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.world = World(rank=0, size=size, local_rank=0, local_size=size, master_addr="127.0.0.1", master_port=port)
        environment = _ranks_environment(accelerator, size, port)
        os.environ.update({**environment, "RANK": "0", "LOCAL_RANK": "0"})
        self.processes = []
        for rank in range(1, size):
            process = subprocess.Popen([sys.executable, "-m", "accelgen.ray.replica_ranks"], stdin=subprocess.PIPE,
                                       env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                       preexec_fn=_end_with_parent)
            process.stdin.write(pickle.dumps((recipe, rank, self.world)))
            process.stdin.close()
            self.processes.append(process)
        threading.Thread(target=self._watch, name="accelgen-replica-ranks", daemon=True).start()

    def _watch(self) -> None:
        """End this process (the replica) as soon as one of its ranks has ended."""
        while True:
            self.end_if_a_rank_ended()
            time.sleep(WATCH_SECONDS)

    def end_if_a_rank_ended(self, within: float = 0.0) -> None:
        """End this process (the replica) if one of its ranks has ended, or does within ``within`` seconds (a collective
        that failed because a rank is gone may fail before the rank's end is seen): the driver finds the replica lost
        and starts it again."""
        deadline = time.monotonic() + within
        while True:
            if any(process.poll() is not None for process in self.processes):
                os._exit(1)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def hand(self, call: Sequence[tuple[int, object]] | str) -> None:
        """Give the ranks the next call: its rows, or ``REPORT`` (what the replica did: its ranks' figures gathered).
        A broadcast broken by a rank gone ends the replica (the driver starts it again), not the job."""
        try:
            torch.distributed.broadcast_object_list([call], src=0)
        except Exception:
            self.end_if_a_rank_ended(within=RANK_END_SECONDS)
            raise


def _ranks_environment(accelerator, size: int, port: int) -> dict[str, str]:
    """What every rank of the replica needs set: where the store is, how many ranks, and what the device's plugin sets
    for ranks it launches; the node's threads Ray gave the replica, shared between its ranks."""
    environment = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(size),
                   "LOCAL_WORLD_SIZE": str(size)}
    given = os.environ.get("OMP_NUM_THREADS", "")  # Ray sets it to the CPUs it gave the actor
    if given.isdigit():
        environment["OMP_NUM_THREADS"] = str(max(1, int(given) // size))
        torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))  # rank 0 read the variable when torch started
    plan = LaunchPlan(world_size=size, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=port)
    for name, value in accelerator.worker_environment(plan).items():
        environment.setdefault(name, value)
    return environment


def _receive() -> list[tuple[int, object]] | str:
    """Rank 0's next call: rows, or ``REPORT``."""
    box: list = [None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _end_with_parent() -> None:
    """In a rank's process, before it runs: SIGKILL it when rank 0 (its parent) ends, however that ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def follow(recipe, rank: int, world: World) -> None:
    """Rank ``rank`` of the replica: load its part of the model, then take each of rank 0's calls with it, until rank 0
    ends (and this rank with it)."""
    import dataclasses

    from accelgen.ray.replica import Failed, Replica

    replica = Replica(recipe, world=dataclasses.replace(world, rank=rank, local_rank=rank))
    if isinstance(loaded := replica.load(), Failed):
        print(f"accelgen: error: [rank {rank}] {loaded.error}", file=sys.stderr)
        sys.exit(2)
    while True:
        call = _receive()
        if call == REPORT:
            replica.report()
        else:
            replica.complete(call)


if __name__ == "__main__":
    follow(*pickle.load(sys.stdin.buffer))
