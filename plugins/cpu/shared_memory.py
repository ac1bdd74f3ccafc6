"""DeepSpeed's shared-memory all-reduce on CPU (its CPU accelerator's ``deepspeed_shm_comm`` kernel), set up
right and cleaned up after: what running DeepSpeed-Inference with several CPU ranks on one machine needs.

The behaviour worked around is DeepSpeed 0.19's (its CPU accelerator and shared-memory all-reduce).
"""

from __future__ import annotations

import os

from accelgen.common.settings import LaunchPlan, World
from accelgen.parallel.deepspeed_adapter import deepspeed_quiet
from accelgen.parallel.process_groups import wait_for_every_rank


def prepare_shared_memory_all_reduce(world: World) -> bool:
    """Get DeepSpeed's shared-memory all-reduce kernel right; True when it will be used, when all ranks share
    a machine: then ``shard_with_deepspeed`` must be told how many (``host_ranks``), or the kernel runs
    uninitialised and the rank dies with SIGSEGV. Across nodes the kernel is turned off, and gloo's all-reduce
    is used instead."""
    with deepspeed_quiet():  # the first import of DeepSpeed: its logger's handler is made now
        import deepspeed.ops

    if world.local_size == world.size:
        return True
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return False


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
    return os.path.join("/dev/shm", f"deepspeed_allreduce_buffer_{os.getuid()}_{master_addr}_{master_port}_{rank}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
