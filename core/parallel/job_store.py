"""The key-value store every rank of a data-parallel job (``--data-parallel R``) shares, and the replicas'
process groups built on it.

The tensor-parallel process group of a job of one replica is made on it too. The launcher already runs one store
for its workers' rendezvous (torch's elastic agent hosts a TCPStore at
MASTER_ADDR:MASTER_PORT; under DeepSpeed's launcher, rank 0 hosts it there): the replicas meet in it and
need no server of ours. Each replica's ranks form the default process group of their processes, under
their own prefix of the store, so that everything that works within a tensor-parallel job (DeepSpeed's
split, the vocabulary-parallel layers, barriers and gathers) works unchanged within a replica, and no
collective spans two replicas: a replica never waits for another.
"""

from __future__ import annotations

import datetime
import functools

import torch

from accelgen.common.settings import World
from accelgen.parallel.worker_processes import restarts_so_far

#: How long a store operation may wait (a replica's other ranks wait for its leader's next row number).
STORE_TIMEOUT = datetime.timedelta(minutes=30)


@functools.cache
def job_store() -> torch.distributed.Store:
    """This process's connection to the job's store (made once), its keys under accelgen's own prefix and the
    workers' start: the agent's store outlives a restart of the workers (``--max-restarts``), whose keys from the
    start before (ranks' addresses, counts of ranks joined) must not be read as theirs."""
    store, _, _ = next(torch.distributed.rendezvous("env://", timeout=STORE_TIMEOUT))
    return torch.distributed.PrefixStore(f"accelgen/start{restarts_so_far()}/", store)


def join_replicas(world: World, backend: str) -> None:
    """Meet the job's other ranks in the store (every rank must call this once, before it writes anything),
    then join this replica's process group when the replica has several ranks."""
    store = job_store()
    if store.add("joined", 1) == world.replicas * world.size:
        store.set("all joined", "")
    store.wait(["all joined"])
    if world.size > 1:
        torch.distributed.init_process_group(
            backend=backend, store=torch.distributed.PrefixStore(f"replica{world.replica}/", store),
            rank=world.rank, world_size=world.size, timeout=STORE_TIMEOUT,
        )
