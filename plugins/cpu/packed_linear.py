"""Linear layers whose weights are laid out once, at load, in oneDNN's blocked format for the run's number of rows.

torch's plain product (``F.linear``) takes the weight as stored, row-major [out, in], and the matrix library re-reads
it in that layout at every call; oneDNN's own blocked layout, made once, feeds its kernels directly: on this
project's AVX-512 machine, products 1.1 to 2x faster (RESULTS.md, "Packed weights on the CPU"). The packed weight
takes the place of the plain one (same bytes, a copy of the process's own where the plain one was the file's map).

Only plain ``nn.Linear`` layers in float32 or bfloat16 with a weight of their own are packed: a head tied to the
input embedding keeps the embedding's matrix (the lookup needs it whole), layers that tensor parallelism or int8
replaced are other modules, and offloaded weights arrive at each forward pass. The packed weight is an opaque
oneDNN tensor: inductor cannot take it as an input, so a compiled step calls the product as an operator that finds
the weight by a number: the plugin's C++ one (``kernels/packed_linear.cpp``, called from the compiled step's C++
wrapper) where the kernels are built, else :func:`packed_product`, a Python one; an eager step calls oneDNN directly.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any

import torch

from accelgen_cpu.native_kernels import native_kernels

#: packed weights (or what holds them) by handle, for compiled steps' operators; the layers hold them (weakly
#: held here)
_PACKED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_handles = itertools.count()


def register_packed(packed: Any) -> int:
    """A handle by which a compiled step's operator finds ``packed`` (:func:`find_packed`), as long as it lives."""
    handle = next(_handles)
    _PACKED[handle] = packed
    return handle


def find_packed(handle: int) -> Any:
    return _PACKED[handle]


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s product over a weight packed for ``rows`` rows (any number of rows still works)."""

    def __init__(self, linear: torch.nn.Linear, rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.weight = torch.nn.Parameter(packed, requires_grad=False)  # a parameter: counted with the model's
        self.bias = linear.bias
        self.handle = register_packed(self.weight)
        #: the weight's number among the C++ operator's; None without the plugin's kernels
        self.native_handle = torch.ops.accelgen_cpu_kernels.keep_packed(self.weight) if native_kernels() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if self.native_handle is not None:
                return torch.ops.accelgen_cpu_kernels.packed_linear(x, self.native_handle, self.out_features, self.bias)
            return packed_product(x, self.handle, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.library.custom_op("accelgen_cpu::packed_product", mutates_args=())
def packed_product(x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times the packed weight ``handle`` [out, in], plus ``bias``: [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, find_packed(handle), bias, "none", [], "")


@packed_product.register_fake
def _(x, handle, out_features, bias):
    return x.new_empty(*x.shape[:-1], out_features)


def pack_linear_layers(model: torch.nn.Module, rows: int) -> int:
    """Replace the model's packable linear layers (module docstring) by :class:`PackedLinear` ones laid out for
    ``rows`` rows, one at a time (the plain weight is freed as its packed copy is made); returns how many."""
    if not _packing_works():
        return 0
    uses: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        uses[id(parameter)] = uses.get(id(parameter), 0) + 1
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is torch.nn.Linear and uses.get(id(child.weight)) == 1 and not child.weight.is_meta
                    and child.weight.dtype in (torch.float32, torch.bfloat16)):
                setattr(parent, name, PackedLinear(child, rows))
                packed += 1
    return packed


@functools.cache
def _packing_works() -> bool:
    """Whether this torch build has oneDNN's packed product and it gives the plain product's values."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, rows = torch.linspace(-1, 1, 32 * 16).reshape(32, 16), torch.linspace(1, -1, 3 * 16).reshape(3, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 3)
        product = torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return torch.allclose(product, torch.nn.functional.linear(rows, weight), atol=1e-5)
