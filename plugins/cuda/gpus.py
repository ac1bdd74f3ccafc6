"""Peak figures of known NVIDIA GPUs, for the memory-bandwidth roofline in reports.

Figures are NVIDIA's datasheet values: memory bandwidth in GB/s and dense BF16 Tensor Core
TFLOPS (datasheets print the 2:4-sparsity figure, twice the dense one; the dense one is used here).
None where the part has no BF16 Tensor Cores (V100) or NVIDIA publishes no figure (A10G).

A GPU is recognised from the name ``torch.cuda.get_device_name()`` reports, e.g. "NVIDIA H100 80GB HBM3"
(the SXM part), "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "Tesla V100-SXM2-32GB".
The first pattern that matches wins, so specific variants come before the general name.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class GpuPeaks:
    """Datasheet peaks of one GPU model."""

    model: str  # the variant the figures belong to, e.g. "H100 SXM"
    memory_bandwidth_gbps: float
    bf16_tflops: float | None  # dense


# (pattern on the upper-cased device name, peaks), most specific first.
KNOWN_GPUS: tuple[tuple[str, GpuPeaks], ...] = (
    (r"\bH200 NVL\b", GpuPeaks("H200 NVL", 4800, 835)),
    (r"\bH200\b", GpuPeaks("H200 SXM", 4800, 989)),
    (r"\bH100 NVL\b", GpuPeaks("H100 NVL", 3900, 835)),
    (r"\bH100\b.*\bPCIE\b", GpuPeaks("H100 PCIe", 2000, 756)),
    (r"\bH100\b", GpuPeaks("H100 SXM", 3350, 989)),
    (r"\bA100\b.*\bSXM.*\b80GB\b", GpuPeaks("A100 SXM 80GB", 2039, 312)),
    (r"\bA100\b.*\bSXM", GpuPeaks("A100 SXM 40GB", 1555, 312)),
    (r"\bA100\b.*\b80GB\b.*\bPCIE\b|\bA100\b.*\bPCIE\b.*\b80GB\b", GpuPeaks("A100 PCIe 80GB", 1935, 312)),
    (r"\bA100\b.*\bPCIE\b", GpuPeaks("A100 PCIe 40GB", 1555, 312)),
    (r"\bL40S\b", GpuPeaks("L40S", 864, 362)),
    (r"\bL40\b", GpuPeaks("L40", 864, 181)),
    (r"\bL4\b", GpuPeaks("L4", 300, 121)),
    (r"\bA10G\b", GpuPeaks("A10G", 600, None)),
    (r"\bA10\b", GpuPeaks("A10", 600, 125)),
    (r"\bV100S\b", GpuPeaks("V100S", 1134, None)),
    (r"\bV100\b", GpuPeaks("V100", 900, None)),
)


def known_gpu_peaks(device_name: str) -> GpuPeaks | None:
    """The datasheet peaks of the GPU named ``device_name``, or None when it is not in the table."""
    upper_name = device_name.upper()
    for pattern, peaks in KNOWN_GPUS:
        if re.search(pattern, upper_name):
            return peaks
    return None
