"""DeepSpeed's shared-memory all-reduce on CPU (its CPU accelerator's ``deepspeed_shm_comm`` kernel), set up
right and cleaned up after: what running DeepSpeed-Inference with several CPU ranks on one machine needs.

The behaviour worked around is DeepSpeed 0.19's (its CPU accelerator and shared-memory all-reduce).
"""

from __future__ import annotations

import os
import warnings

from accelgen.common.errors import AccelgenWarning, reason
from accelgen.common.settings import LaunchPlan, World
from accelgen.parallel.deepspeed_adapter import deepspeed_quiet
from accelgen.parallel.process_groups import gather_from_ranks, wait_for_every_rank

SHARED_MEMORY = "/dev/shm"

#: the size of the segment each rank makes (``struct allreduce_workspace`` in DeepSpeed's shm.cpp: two 1 MiB
#: buffers for small messages, two 32 MiB ones for large, two state words)
BUFFER_BYTES = 2 * 2**20 + 2 * 32 * 2**20 + 8


def prepare_shared_memory_all_reduce(world: World) -> bool:
    """Get DeepSpeed's shared-memory all-reduce kernel right; True when it will be used: when all ranks share a
    machine and each could make its buffer. Then ``shard_with_deepspeed`` must be told how many ranks share it
    (``host_ranks``), or the kernel runs uninitialised and the rank dies with SIGSEGV. Otherwise the kernel is
    turned off, on every rank alike, and gloo's all-reduce is used instead.

    DeepSpeed writes each rank's buffer into /dev/shm without checking that the write fitted: where /dev/shm (or
    the memory behind it) is short, a rank dies with SIGSEGV while it joins, or maps part of its buffer and dies
    with SIGBUS at a later large all-reduce (a container's default /dev/shm, 64 MiB, holds less than one buffer).
    So each rank first makes its buffer itself, at DeepSpeed's name, every byte allocated: DeepSpeed's write then
    fills memory that exists."""
    with deepspeed_quiet():  # the first import of DeepSpeed: its logger's handler is made now
        import deepspeed.ops

    if world.local_size == world.size:
        # every rank decides alike: a rank using the kernel would wait for ever on one that does not
        refusals = [refusal for refusal in gather_from_ranks(_make_buffer(world), world) if refusal is not None]
        if not refusals:
            return True
        _unlink(_buffer_path(world.master_addr, world.master_port, world.rank))
        free = shared_memory_free_bytes()
        warnings.warn(AccelgenWarning(
            f"DeepSpeed's shared-memory all-reduce needs {BUFFER_BYTES / 2**20:.0f} MiB of {SHARED_MEMORY} per rank "
            f"and a rank could not have it ({refusals[0]}"
            + ("" if free is None else f"; {free / 2**20:.0f} MiB free") +
            "): the ranks reduce over gloo instead (slower); free some, or give a container more "
            "(docker run --shm-size=1g)"
        ), stacklevel=2)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return False


def shared_memory_free_bytes() -> int | None:
    """The bytes free in /dev/shm, or None where there is none to look at."""
    try:
        status = os.statvfs(SHARED_MEMORY)
    except OSError:
        return None
    return status.f_bavail * status.f_frsize


def _make_buffer(world: World) -> str | None:
    """Make this rank's all-reduce buffer where DeepSpeed will open it, its memory allocated; why it could not, or
    None. Nothing is made where shared memory is not a /dev/shm folder (shm_open names live elsewhere there)."""
    if not (hasattr(os, "posix_fallocate") and os.path.isdir(SHARED_MEMORY)):
        return None
    try:
        descriptor = os.open(_buffer_path(world.master_addr, world.master_port, world.rank), os.O_CREAT | os.O_RDWR,
                             0o600)
        try:
            os.posix_fallocate(descriptor, 0, BUFFER_BYTES)
        finally:
            os.close(descriptor)
    except OSError as error:
        return reason(error)
    return None


def unlink_shared_memory_buffer(world: World, wait: bool = True) -> None:
    """Remove this rank's name of DeepSpeed's shared-memory all-reduce buffer once every rank has mapped it
    (without ``wait``, at once: when the sharding failed and the job ends).

    When its ranks share a host, DeepSpeed creates one POSIX shared-memory segment per rank while it joins
    (inside ``init_inference``) and never unlinks it, so every job would leave its buffers in /dev/shm.
    After a barrier every rank has opened every other's segment, so the names can go: the mappings stay
    valid and the memory is freed when the last rank exits. Where DeepSpeed made no such buffer (several
    hosts) there is nothing to remove."""
    if wait:
        wait_for_every_rank()
    _unlink(_buffer_path(world.master_addr, world.master_port, world.rank))


def remove_buffers_left(plan: LaunchPlan) -> None:
    """Remove the buffers of this node's ranks of the job ``plan`` that are still named once its ranks have ended: a
    rank killed while DeepSpeed joined (after it made its buffer, before it could remove its name) leaves one."""
    first = plan.node_rank * plan.processes_per_node
    for rank in range(first, first + plan.processes_per_node):
        _unlink(_buffer_path(plan.master_addr, plan.master_port, rank))


def _buffer_path(master_addr: str, master_port: int, rank: int) -> str:
    """Where DeepSpeed's CPU accelerator names rank ``rank``'s buffer (by the job's address and port)."""
    return os.path.join(SHARED_MEMORY, f"deepspeed_allreduce_buffer_{os.getuid()}_{master_addr}_{master_port}_{rank}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
