"""Test double of ``habana_frameworks.torch.hpu``: not Habana's software.

Answers as one Gaudi card per process would (``HABANA_DOUBLE_DEVICE_NAME``, default ``GAUDI2``;
``HABANA_DOUBLE_DEVICE_COUNT`` cards, default 8), with tensors on the CPU (see the end of this module).
Memory figures are the process's peak resident memory, standing in for the card's.
"""

import os
import resource

import torch

from habana_frameworks.torch import double_record
from habana_frameworks.torch.hpu.graphs import wrap_in_hpu_graph, wrap_in_hpu_graph_func  # noqa: F401

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


def _keep_tensors_on_the_cpu() -> None:
    """The real bridge registers the ``hpu`` device with torch when imported, which a pure-Python double
    cannot do: so the double points the plugin's device at the CPU. This is the one place that knows."""
    import accelgen_hpu.bridge

    accelgen_hpu.bridge.torch_device = lambda: torch.device("cpu")


_keep_tensors_on_the_cpu()
