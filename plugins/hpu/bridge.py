"""Reaching Habana's software stack: the PyTorch bridge (``habana_frameworks.torch``) and what it tells.

Everything Habana-specific that is not a hook lives here, so that the accelerator in ``__init__`` reads
as the contract. The bridge is imported only inside these functions: ``import accelgen_hpu`` works on
any machine, and ``accelgen devices`` can say why Gaudi is unavailable.

Lazy mode: the bridge reads ``PT_HPU_LAZY_MODE`` once, when it is first imported. accelgen runs in
lazy mode (``1``, Habana's mode for HPU graphs and the one its inference guides use) unless the user
set the variable; :func:`import_bridge` sets that default before the first import, which is why every
use of the bridge goes through it.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

#: What to install, named once for every message that needs it.
INSTALL_HINT = (
    "install Intel Gaudi software with Habana's installer (its PyTorch and Habana's PyTorch bridge "
    "habana_frameworks.torch) and keep its torch when installing accelgen, and for --world-size > 1 Habana's "
    "DeepSpeed fork at your Gaudi software's release tag (pip install git+https://github.com/HabanaAI/DeepSpeed.git@1.21.0 "
    "for 1.21)"
)

#: Peak figures per Gaudi generation, from Intel's own table (Hot Chips 2024, "Intel Gaudi 3 AI Accelerator:
#: Architected for Gen AI Training and Inference", product parameters: peak BF16 compute, HBM capacity and
#: peak HBM bandwidth). Keys are prefixes of ``hpu.get_device_name()``, newest first ("GAUDI" matches all).
GAUDI_GENERATIONS = (
    ("GAUDI3", dict(generation="Gaudi3", memory_gb=128, peak_memory_bandwidth_gbps=3670, peak_bf16_tflops=1835)),
    ("GAUDI2", dict(generation="Gaudi2", memory_gb=96, peak_memory_bandwidth_gbps=2460, peak_bf16_tflops=432)),
    ("GAUDI", dict(generation="Gaudi", memory_gb=32, peak_memory_bandwidth_gbps=900, peak_bf16_tflops=60)),
)


def import_bridge() -> tuple[ModuleType, ModuleType]:
    """``(habana_frameworks.torch.core, habana_frameworks.torch.hpu)``, imported in lazy mode unless the
    user set ``PT_HPU_LAZY_MODE`` otherwise."""
    os.environ.setdefault("PT_HPU_LAZY_MODE", "1")
    import habana_frameworks.torch.core as htcore
    import habana_frameworks.torch.hpu as hpu

    return htcore, hpu


def unavailable_reason() -> str | None:
    """None when a Gaudi card can be used here, else one sentence saying what is missing and what to do."""
    try:
        _, hpu = import_bridge()
    except Exception as error:  # noqa: BLE001 - a missing package, or a bridge whose native libraries fail to load
        return f"Habana's software stack cannot be imported ({type(error).__name__}: {error}); {INSTALL_HINT}."
    if not hpu.is_available():
        return (
            "habana_frameworks.torch is installed but sees no Gaudi card: check that hl-smi lists the cards "
            "and that the habanalabs driver is loaded."
        )
    return None


def torch_device() -> torch.device:
    """The device tensors are placed on: ``hpu``, which importing the bridge registers with torch."""
    return torch.device("hpu")


def generation_facts(device_name: str) -> dict:
    """Generation and peak figures for a ``get_device_name()`` such as ``"GAUDI2"`` (None for unknown names)."""
    for prefix, facts in GAUDI_GENERATIONS:
        if device_name.upper().startswith(prefix):
            return dict(facts)
    return dict(generation=None, memory_gb=None, peak_memory_bandwidth_gbps=None, peak_bf16_tflops=None)


def bridge_version() -> str | None:
    """The installed bridge's version (it follows the Intel Gaudi software release), when it says."""
    import habana_frameworks.torch

    version = getattr(habana_frameworks.torch, "__version__", None)
    return f"habana_frameworks.torch {version}" if version else None
