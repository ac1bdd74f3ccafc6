"""The process group of a tensor-parallel job (or of one replica of a data-parallel job): joining it, leaving
it, and what the ranks exchange outside the model (results gathered for rank 0 to print, a turn to download
taken by one process per node)."""

from __future__ import annotations

import contextlib

import torch

from accelgen.common.settings import World
from accelgen.parallel.job_store import job_store, join_replicas


def init_process_group(world: World, backend: str) -> None:
    """Join this process to its replica's process group: the job's, unless the job runs several replicas
    (``accelgen.parallel.job_store``). A no-op for a single process or when already joined."""
    if world.replicas > 1:
        join_replicas(world, backend)
    elif world.size > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=backend, store=job_store(), rank=world.rank, world_size=world.size)


def leave_process_group() -> None:
    """Wait for every rank, then tear the process group down, so no rank exits with collectives
    (or the communication threads behind them) still running."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def wait_for_every_rank() -> None:
    """A barrier over the job (nothing in a single process)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def gather_from_ranks(value, world: World) -> list:
    """``value`` from every rank, in rank order (every rank must call this)."""
    if world.size == 1 or not torch.distributed.is_initialized():
        return [value]
    values = [None] * world.size
    torch.distributed.all_gather_object(values, value)
    return values


@contextlib.contextmanager
def one_process_per_node_first(world: World):
    """Run the block in local rank 0 of each node first, then in the node's other ranks (every rank must
    enter): the first fills a node's cache (a download), the others then find it there."""
    if world.local_rank != 0:
        wait_for_every_rank()
    try:
        yield
    finally:
        if world.local_rank == 0:
            wait_for_every_rank()
