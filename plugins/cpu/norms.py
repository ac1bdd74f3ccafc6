"""RMSNorm modules on the CPU: one C++ operator (``kernels/rms_norm.cpp``) instead of their seven.

A decode step of the dataset model of benchmarks/cpu_peers.py runs nine of them (two per layer and the last),
about 300 us of its 6.7 ms in eager operations; the operator computes the same values (the sum of squares in another
order: a last-bit difference at most) in one pass. Compiled steps keep the modules' own operations, which inductor
fuses itself.

Which modules take it is decided by what they compute, not by their class's name: families write their RMSNorm
differently (Gemma's scales by 1 + weight and rounds after scaling; OLMo 2's rounds after the weight), and
transformers marks the ones a hub kernel may replace only where the ``kernels`` package is installed. So each class
of module that holds a ``weight`` vector and a ``variance_epsilon`` is run once on probe rows, with a random weight,
beside the operator: its modules take the operator only where the two agree (to the bit in 16-bit types, to the last
bits in float32), in the dtype the model runs in.
"""

from __future__ import annotations

import copy

import torch

from accelgen_cpu.native_kernels import native_operator


def use_fused_norms(model: torch.nn.Module) -> int:
    """Give the model's RMSNorm modules that compute what the C++ operator computes the operator, where this CPU's
    kernels take it; how many took it."""
    operator = native_operator("rms_norm")
    if operator is None:
        return 0
    agrees: dict[type, bool] = {}
    given = 0
    for module in model.modules():
        if not _holds_a_norm(module):
            continue
        if type(module) not in agrees:
            agrees[type(module)] = _computes_as(module, operator)
        if agrees[type(module)]:
            module.forward = _fused_forward(module, module.forward, operator)
            given += 1
    return given


def _holds_a_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(getattr(module, "variance_epsilon", None), float) and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and not list(module.children()))


@torch.no_grad()
def _computes_as(module: torch.nn.Module, operator) -> bool:
    """Whether ``module``'s forward gives the operator's values on probe rows (a copy of it, with a random weight, in
    its own dtype)."""
    probe = copy.deepcopy(module)
    dtype, width = probe.weight.dtype, probe.weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    probe.weight.copy_(torch.randn(width, generator=generator).to(dtype))
    rows = (torch.randn(5, width, generator=generator) * 3).to(dtype)
    try:
        theirs = probe(rows)
    except Exception:  # noqa: BLE001 - a module that does not take a plain row is no norm the operator replaces
        return False
    ours = operator(rows, probe.weight, probe.variance_epsilon)
    if not isinstance(theirs, torch.Tensor) or theirs.dtype != ours.dtype or theirs.shape != ours.shape:
        return False
    if dtype == torch.float32:
        return torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    return torch.equal(ours, theirs)


def _fused_forward(module: torch.nn.Module, own_forward, operator):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or module.weight.dtype != hidden_states.dtype:
            return own_forward(hidden_states)
        return operator(hidden_states, module.weight, module.variance_epsilon)

    return forward
