"""Llama-family RMSNorm modules on the CPU: one C++ operator (``kernels/rms_norm.cpp``) instead of their seven.

A decode step of the dataset model of benchmarks/cpu_peers.py runs nine of them (two per layer and the last),
about 300 us of its 6.7 ms in eager operations; the operator computes the same values (the sum of squares in another
order: a last-bit difference at most) in one pass. Compiled steps keep the modules' own operations, which inductor
fuses itself.
"""

from __future__ import annotations

import torch

from accelgen_cpu.native_kernels import native_operator

#: RMSNorm modules whose forward is transformers' Llama one (weight * normalized x rounded to x's dtype); Gemma's,
#: for one, scales by 1 + weight, so this is a table of names, not a guess from attributes
RMS_NORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def use_fused_norms(model: torch.nn.Module) -> int:
    """Give the model's RMSNorm modules of :data:`RMS_NORM_CLASSES` the C++ operator, where this CPU's kernels take
    it; how many took it."""
    operator = native_operator("rms_norm")
    given = 0
    for module in model.modules():
        if operator is not None and type(module).__name__ in RMS_NORM_CLASSES and isinstance(getattr(module, "variance_epsilon", None), float):
            module.forward = _fused_forward(module, module.forward, operator)
            given += 1
    return given


def _fused_forward(module: torch.nn.Module, own_forward, operator):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or module.weight.dtype != hidden_states.dtype:
            return own_forward(hidden_states)
        return operator(hidden_states, module.weight, module.variance_epsilon)

    return forward
