"""Peak figures of known NVIDIA GPUs, for the memory-bandwidth roofline in reports.

Figures are NVIDIA's datasheet values: memory bandwidth in GB/s and dense BF16 Tensor Core
TFLOPS (datasheets print the 2:4-sparsity figure, twice the dense one; the dense one is used here).
None where the part has no BF16 Tensor Cores (V100) or NVIDIA publishes no figure (A10G).

A GPU is recognised from the name ``torch.cuda.get_device_name()`` reports, e.g. "NVIDIA H100 80GB HBM3"
(the SXM part), "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "Tesla V100-SXM2-32GB".
The table is ``gpu_peaks.json`` beside this file; the first pattern that matches wins, so specific variants
come before the general name.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import re


@dataclasses.dataclass(frozen=True)
class GpuPeaks:
    """Datasheet peaks of one GPU model."""

    model: str  # the variant the figures belong to, e.g. "H100 SXM"
    memory_bandwidth_gbps: float
    bf16_tflops: float | None  # dense


@functools.cache
def known_gpus() -> tuple[tuple[str, GpuPeaks], ...]:
    """(pattern on the upper-cased device name, peaks), most specific first, from ``gpu_peaks.json``."""
    rows = json.loads(importlib.resources.files("accelgen_cuda").joinpath("gpu_peaks.json").read_text(encoding="utf-8"))
    return tuple((row["pattern"], GpuPeaks(row["model"], row["memory_bandwidth_gbps"], row["bf16_tflops"])) for row in rows)


def known_gpu_peaks(device_name: str) -> GpuPeaks | None:
    """The datasheet peaks of the GPU named ``device_name``, or None when it is not in the table."""
    upper_name = device_name.upper()
    for pattern, peaks in known_gpus():
        if re.search(pattern, upper_name):
            return peaks
    return None
