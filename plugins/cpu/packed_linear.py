"""Linear layers whose weights are laid out once, at load, for the CPU's products.

torch's plain product (``F.linear``) takes the weight as stored, row-major [out, in], and the matrix library re-reads
it in that layout at every call. Two layouts made once feed kernels directly:

- float32 weights, where this processor's kernels take them (AVX-512 and AVX2): panels of 16 outputs
  (:func:`pack_float_panels`), multiplied by the plugin's C++ operator (``kernels/float_panels_linear.cpp``), which
  reads one layout well for every number of rows: one row (a batch-1 decode step, bound by reading the weight) and
  16 (a prompt, a batch) both faster than over either of oneDNN's layouts, each good at one of the two (RESULTS-log.md,
  "float32 products in panels"); a row's result depends on that row alone;
- otherwise (bfloat16, or no kernels): oneDNN's own blocked layout for the run's number of rows, faster than the
  plain one (RESULTS-log.md, "Packed weights on the CPU"), where oneDNN multiplies that type on this CPU (bfloat16 needs
  AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2 CPU keeps bfloat16 layers plain).

The laid-out weight takes the place of the plain one (same bytes, a copy of the process's own where the plain one was
the file's map).

Only plain ``nn.Linear`` layers in float32 or bfloat16 with a weight of their own are packed: a head tied to the
input embedding keeps the embedding's matrix (the lookup needs it whole), layers that tensor parallelism or int8
replaced are other modules, and offloaded weights arrive at each forward pass. The panels are a plain tensor, which
compiled steps take as any other. oneDNN's packed weight is an opaque tensor, which inductor cannot take as an input,
so a compiled step calls its product as an operator that finds the weight by a number: the plugin's C++ one
(``kernels/packed_linear.cpp``, called from the compiled step's C++ wrapper) where the kernels are built, else
:func:`packed_product`, a Python one; an eager step calls oneDNN directly.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any

import torch

from accelgen_cpu.native_kernels import loaded_kernels, native_operator

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
        self._native_product = native_operator("packed_linear")
        self.native_handle = None if self._native_product is None else loaded_kernels().operators.keep_packed(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a compiled or traced step calls an operator that finds the weight by its handle (the compiler takes no
        # oneDNN tensor as input; the tracer records no call with the list of optional scalars oneDNN's product takes)
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            if self._native_product is not None:
                return self._native_product(x, self.native_handle, self.out_features, self.bias)
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


class FloatPanelsLinear(torch.nn.Module):
    """``nn.Linear``'s product over a float32 weight laid out in panels of 16 outputs (:func:`pack_float_panels`)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.nn.Parameter(pack_float_panels(linear.weight.detach()), requires_grad=False)
        self.bias = linear.bias
        self._operator = native_operator("float_panels_linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._operator(x, self.weight, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class FloatPanels:
    """A float32 weight [out, in] the core writes itself (``Accelerator.linear_layout``), laid out in panels for the
    plugin's product, and laid out again, in place, whenever the core has written it."""

    def __init__(self, weight: torch.Tensor, operator) -> None:
        self.weight, self.out_features, self._operator = weight, weight.shape[0], operator
        self.panels = pack_float_panels(weight)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return self._operator(x, self.panels, self.out_features, None)

    def refresh(self) -> None:
        self.panels.copy_(pack_float_panels(self.weight))


def pack_float_panels(weight: torch.Tensor) -> torch.Tensor:
    """The float32 ``weight`` [out, in] as the panels kernel reads it, [out * in]: panels of 16 outputs, each holding
    its outputs' weights input by input ([in, 16]), the last the ``out % 16`` outputs left ([in, out % 16]), so that
    the panels take the weight's bytes, no more."""
    outputs, inputs = weight.shape
    whole = outputs // 16 * 16
    panels = torch.empty(outputs * inputs, dtype=weight.dtype)  # written in place: one copy, no temporaries
    panels[: whole * inputs].view(-1, inputs, 16).copy_(weight[:whole].reshape(-1, 16, inputs).transpose(1, 2))
    panels[whole * inputs:].view(inputs, outputs - whole).copy_(weight[whole:].t())
    return panels


def pack_linear_layers(model: torch.nn.Module, rows: int) -> int:
    """Replace the model's packable linear layers (module docstring) by :class:`FloatPanelsLinear` ones (float32
    weights, where the kernel is built) or :class:`PackedLinear` ones laid out for ``rows`` rows, one at a time (the
    plain weight is freed as its laid-out copy is made); returns how many."""
    panels = native_operator("float_panels_linear") is not None  # where this CPU's kernels take it
    uses: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        uses[id(parameter)] = uses.get(id(parameter), 0) + 1
    # the layers by name: a list of the modules themselves would keep every plain weight until the last is laid out
    layers = [(parent_name, name) for parent_name, parent in model.named_modules()
              for name, child in parent.named_children() if type(child) is torch.nn.Linear]
    packed = 0
    for parent_name, name in layers:
        parent = model.get_submodule(parent_name)
        child = getattr(parent, name)
        if uses.get(id(child.weight)) == 1 and not child.weight.is_meta and child.weight.dtype in (torch.float32,
                                                                                                   torch.bfloat16):
            if panels and child.weight.dtype == torch.float32:
                setattr(parent, name, FloatPanelsLinear(child))
            elif packing_works(child.weight.dtype):
                setattr(parent, name, PackedLinear(child, rows))
            else:
                continue
            packed += 1
    return packed


@functools.cache
def packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch build has oneDNN's packed product for ``dtype`` on this CPU and it gives the plain product's
    values (oneDNN refuses bfloat16 on CPUs without AVX-512 BW/VL/DQ or AVX-NE-CONVERT: most AVX2 ones)."""
    if not torch.backends.mkldnn.is_available():
        return False
    weight = torch.linspace(-1, 1, 32 * 16).reshape(32, 16).to(dtype)
    rows = torch.linspace(1, -1, 3 * 16).reshape(3, 16).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 3)
        product = torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    return torch.allclose(product.float(), torch.nn.functional.linear(rows, weight).float(), atol=tolerance,
                          rtol=tolerance)
