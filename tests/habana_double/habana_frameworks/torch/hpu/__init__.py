"""Test double of ``habana_frameworks.torch.hpu``: not Habana's software.

Answers as one Gaudi card per process would (``HABANA_DOUBLE_DEVICE_NAME``, default ``GAUDI2``;
``HABANA_DOUBLE_DEVICE_COUNT`` cards, default 8), with tensors on the CPU (``DEVICE_TYPE_FOR_TESTS``).
Memory figures are the process's peak resident memory, standing in for the card's.
"""

import os
import resource

from habana_frameworks.torch import double_record
from habana_frameworks.torch.hpu.graphs import wrap_in_hpu_graph, wrap_in_hpu_graph_func  # noqa: F401

#: Only in the double: the torch device type tensors really live on (the real bridge registers "hpu").
DEVICE_TYPE_FOR_TESTS = "cpu"

#: The memory "Limit" the double reports: a Gaudi2's 96 GB.
MEMORY_LIMIT_BYTES = 96 * 10**9


def is_available() -> bool:
    return True


def device_count() -> int:
    return int(os.environ.get("HABANA_DOUBLE_DEVICE_COUNT", 8))


def get_device_name() -> str:
    return os.environ.get("HABANA_DOUBLE_DEVICE_NAME", "GAUDI2")


def synchronize() -> None:
    double_record["synchronize"] += 1


def max_memory_allocated() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_stats(device=None) -> dict:
    """The keys of the real ``memory_stats`` that accelgen reads, in bytes."""
    peak = max_memory_allocated()
    return {"InUse": peak, "MaxInUse": peak, "Limit": MEMORY_LIMIT_BYTES}
