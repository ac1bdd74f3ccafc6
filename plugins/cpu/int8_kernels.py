"""The CPU's int8 products: each input row quantized to int8 as it comes (a scale of its own, as CTranslate2 and
OpenVINO do), multiplied in int8 with the layer's int8 weights (byte products: VNNI or AVX2), the int32 sums scaled
back by both scales. Each row's result depends on that row alone, whatever rows share the product.

Four kernels give the same integers; which is fastest depends on the number of rows and the CPU's instructions, so
each layer takes the one a rule over them names (:func:`int8_kernel_for`, from measurements):

- ``"rows"``: torch's ``_int_mm`` over the weight as stored, [out, in] row-major (where oneDNN's product is missing;
  without VNNI it is slower than float32 by 4 to 30x);
- ``"columns"``: ``_int_mm`` over the weight copied input-major;
- ``"packed"``: oneDNN's int8 product over the weight packed once in its blocked layout (``onednn::qlinear``):
  for several rows the fastest by far on AVX-512 (RESULTS-log.md, "int8 products on the CPU"); refused where it does not
  give ``_int_mm``'s values (AVX2 without VNNI: oneDNN's unsigned rows saturate its 16-bit pair sums); on a CPU with
  AMX it multiplies on AMX's int8 tiles;
- ``"fused"``: the plugin's C++ operator (``kernels/int8_linear.cpp``, AVX-512 VNNI's byte products or AVX2's) over the
  weight laid out once in panels of 16 outputs (:func:`pack_int8_panels`): quantization, product and scaling in one
  operator where the others take about ten, each panel read once for several rows; from memory the fastest at one
  row and at 16 (RESULTS-log.md, "int8 products in panels", "int8 products on AVX2"). Layers of any width take it (the
  others: multiples of 16).

oneDNN's product takes one activation scale for all rows, so it is given unscaled rows (scale 1) and each row's
scale is applied to its result afterwards, as for ``_int_mm``; its rows are unsigned (zero point 128): the int8
rows with their sign bit flipped. Every kernel scales the int32 sums as ``(sums * weight scale) * row scale`` in
float32, so that the kernels give the same values and the choice never changes a token.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from accelgen.common.static_sizes import static_shape
from accelgen.quantization.int8_layer import INT8_LIMIT, Int8Linear, int8_product, quantize_rows
from accelgen_cpu.kernel_variants import instruction_sets
from accelgen_cpu.native_kernels import native_operator
from accelgen_cpu.packed_linear import find_packed, register_packed

#: the kernels a weight shape may take, in the order they are tried
KERNELS = ("rows", "columns", "packed", "fused")
#: oneDNN's unsigned rows: the int8 values plus this (the sign bit flipped)
_ZERO_POINT = 128
#: 0x80808080 as an int32: each of a word's four bytes with its sign bit flipped (int8 to oneDNN's unsigned form)
_SIGN_BITS = -0x7F7F7F80
# the smallest largest magnitude a row is quantized with: 127 over it is finite, so a row of zeros gives zeros
_TINY = 2.0**-100


def int8_product_on_cpu(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The product of ``x`` [rows, in] and the int8 ``weight`` [out, in] (either layout) through ``_int_mm``. The kernel
    needs rows of a multiple of 16 values (others give wrong values or crash): other layers take the plain product."""
    if static_shape(x)[-1] % 16:  # a number while a step is traced, so that the trace holds the branch taken
        return int8_product(x, weight, scales)
    values, row_scales = _last_input.quantized_rows(x, quantize_input_rows)
    sums = torch._int_mm(values, weight.t()).float().mul_(scales.float())  # as oneDNN's, to the last bit
    return sums.mul_(row_scales).to(x.dtype)


class _LastInput:
    """The last input's quantized rows, for the layers that take the same input in turn (an attention's query, key and
    value projections; an MLP's gate and up projections): its rows are quantized once. The input is recognised by its
    memory, shape, strides and version (an in-place change bumps it), and held, so that its memory cannot be reused
    while it is remembered. Eager steps only: a compiled step's compiler merges the repeated quantization itself, and
    inference-mode tensors keep no version."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._held: torch.Tensor | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def quantized_rows(self, x: torch.Tensor, quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``quantize(x)``, or what it gave for the same input last."""
        if torch.compiler.is_compiling() or x.is_inference():
            return quantize(x)
        key = (quantize, x.data_ptr(), static_shape(x), x.stride(), x.dtype, x._version)  # sizes as numbers in a trace too
        if key != self._key or self._rows is None:
            self._key, self._held, self._rows = key, x, quantize(x)
        return self._rows


_last_input = _LastInput()


def quantize_input_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, in] as int8 values and each row's scale [rows, 1] (its largest magnitude / 127, float32). Not
    :func:`~accelgen.quantization.int8_layer.quantize_rows`, which quantizes weights once at load: this runs at every
    product, so its operations are few (a multiplication instead of a division and a clamp; float to int8, unlike
    float to uint8, is vectorized)."""
    largest = x.abs().amax(-1, keepdim=True).float().clamp_(min=_TINY)
    values = torch.mul(x, torch.div(INT8_LIMIT, largest)).round_().to(torch.int8)
    return values, largest.div_(INT8_LIMIT)  # now each row's scale


def quantize_unsigned_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_input_rows`'s values in oneDNN's unsigned form (:func:`as_unsigned`), and the rows' scales."""
    values, scales = quantize_input_rows(x)
    return as_unsigned(values), scales


class PackedInt8Product:
    """The int8 product over one layer's weight packed by oneDNN (the layer's weight is then :attr:`weight`); an
    :class:`~accelgen.quantization.int8_layer.Int8Linear`'s ``product``. A compiled step calls oneDNN through the
    custom operator :func:`packed_int8_product`, which finds this object by :attr:`handle` (inductor takes no oneDNN
    tensor as input). The weight and scales it is called with are the layer's, which are its own."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        self.weight = torch.nn.Parameter(torch.ops.onednn.qlinear_prepack(weight, None), requires_grad=False)
        self.out_features = weight.shape[0]
        self.scales = scales.float()
        self._zero_points = torch.zeros(self.out_features, dtype=torch.long)  # the weights': symmetric
        self.handle = register_packed(self)
        #: the rows quantized as oneDNN takes them: in one pass of the C++ kernels where they are built (the same
        #: values; torch's operations take about eight passes, a quarter of a prefill's int8 pass of thousands of rows)
        self._quantize = native_operator("quantize_rows_unsigned") or quantize_unsigned_rows

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        unsigned, row_scales = _last_input.quantized_rows(x, self._quantize)
        if torch.compiler.is_compiling():
            scaled_sums = packed_int8_product(unsigned, self.handle, self.out_features)
        else:
            scaled_sums = self.scaled_sums(unsigned)
        return scaled_sums.mul_(row_scales).to(x.dtype)

    def scaled_sums(self, unsigned: torch.Tensor) -> torch.Tensor:
        """oneDNN's int32 sums of the unsigned rows' products, times the weights' scales, in float32."""
        return torch.ops.onednn.qlinear_pointwise(unsigned, 1.0, _ZERO_POINT, self.weight, self.scales,
                                                  self._zero_points, None, 1.0, 0, torch.float32, "none", [], "")


class FusedInt8Product:
    """The plugin's C++ int8 product (quantization, product and scaling in one operator, ``_int_mm``'s values to the
    last bit) over the weight in panels (:func:`pack_int8_panels`; the layer's weight is then :attr:`weight`); an
    :class:`~accelgen.quantization.int8_layer.Int8Linear`'s ``product``."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        self.weight = torch.nn.Parameter(pack_int8_panels(weight), requires_grad=False)
        self.scales = scales.float().contiguous()
        self._operator = native_operator("int8_panels_linear")

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return self._operator(x, self.weight, self.scales)


def pack_int8_panels(weight: torch.Tensor) -> torch.Tensor:
    """The int8 ``weight`` [out, in] as the fused kernel reads it: panels of 16 outputs, each holding the 16 outputs'
    values four inputs at a time ([ceil(out / 16), ceil(in / 4), 16 * 4]), plus 128 (unsigned: VNNI takes one operand
    so). Padding outputs and inputs are zero bytes: the kernel writes no padding output, and gives the rows' padding
    inputs the value zero, so they add nothing."""
    outputs, inputs = weight.shape
    panels, quads = -(-outputs // 16), -(-inputs // 4)
    if (outputs, inputs) != (panels * 16, quads * 4) or weight.storage_offset() % 4 or not weight.is_contiguous():
        padded = torch.full((panels * 16, quads * 4), -_ZERO_POINT, dtype=torch.int8)  # zero bytes once flipped
        padded[:outputs, :inputs] = weight
        weight = padded
    # the layout moves each output's 4 consecutive inputs as one 32-bit word (4x fewer elements than bytes)
    words = torch.empty(panels, quads, 16, dtype=torch.int32)
    words.copy_(weight.view(torch.int32).view(panels, 16, quads).transpose(1, 2))
    words.bitwise_xor_(_SIGN_BITS)
    return words.view(torch.uint8).view(panels, quads, 64)


def as_unsigned(values: torch.Tensor) -> torch.Tensor:
    """int8 ``values`` plus 128, as uint8 (the sign bit flipped): the unsigned operand oneDNN's and VNNI's products
    take."""
    return torch.bitwise_xor(values, -_ZERO_POINT).view(torch.uint8)


@torch.library.custom_op("accelgen_cpu::packed_int8_product", mutates_args=())
def packed_int8_product(unsigned: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """:meth:`PackedInt8Product.scaled_sums` of the product registered as ``handle``: [rows, out] float32."""
    return find_packed(handle).scaled_sums(unsigned)


@packed_int8_product.register_fake
def _(unsigned, handle, out_features):
    return unsigned.new_empty(unsigned.shape[0], out_features, dtype=torch.float32)


#: The rows up to which the fused kernel is taken where it is built (AVX-512 VNNI, AVX2); oneDNN's packed product past
#: them where it gives ``_int_mm``'s values, and at any rows where the fused kernel is not built (benchmarks/RESULTS-log.md,
#: "The CPU kernels per instruction set").
FUSED_ROWS_AT_MOST = 16
#: On a CPU with AMX's int8 tiles, oneDNN's packed product (which multiplies on them) is taken from this many rows on for
#: layers of at least :data:`AMX_INPUTS_AT_LEAST` inputs: 1.4-1.5x the fused kernel's speed at 16 rows, 3.6x at 64,
#: 5x at a prefill's hundreds; the fused one stays faster below 16 rows and on narrow layers at 16 (benchmarks/RESULTS-log.md,
#: "int8 on AMX").
AMX_ROWS_AT_LEAST = 16
AMX_INPUTS_AT_LEAST = 1024


def int8_kernel_for(rows: int, in_features: int, kernels: tuple[str, ...], amx: bool = False) -> str | None:
    """The kernel a layer of ``in_features`` inputs takes for a decode step of ``rows`` rows, of the ``kernels`` this
    machine runs (:func:`available_kernels`): a rule over the instruction sets (whether the fused kernel is built;
    ``amx``: whether the CPU has AMX's int8 tiles), the shape and the rows, so that every run on a machine takes the
    same kernels (never a timing: which kernel is fastest depends on the moment). None: the plain product (a layer
    whose rows are not a multiple of 16 values, which ``_int_mm`` and oneDNN do not take, where the fused kernel is not
    built)."""
    if (amx and "packed" in kernels and not in_features % 16 and rows >= AMX_ROWS_AT_LEAST
            and in_features >= AMX_INPUTS_AT_LEAST):
        return "packed"
    if "fused" in kernels and (in_features % 16 or rows <= FUSED_ROWS_AT_MOST or "packed" not in kernels):
        return "fused"
    if in_features % 16:
        return None
    return "packed" if "packed" in kernels else "rows"


def choose_int8_kernels(model: torch.nn.Module, rows: int) -> dict[str, int]:
    """Give each int8 layer of ``model`` the kernel :func:`int8_kernel_for` names for ``rows`` rows; returns how many
    layers took each kernel."""
    kernels, amx = available_kernels(), "amxint8" in instruction_sets()
    taken: dict[str, int] = {}
    for layer in model.modules():
        if isinstance(layer, Int8Linear):
            kernel = int8_kernel_for(rows, layer.in_features, kernels, amx=amx)
            if kernel is not None:
                use_int8_kernel(layer, kernel)
            taken[kernel or "plain"] = taken.get(kernel or "plain", 0) + 1
    return taken


def use_int8_kernel(layer: Int8Linear, kernel: str) -> None:
    """Make ``layer`` (int8 weights as stored, [out, in] row-major) compute with ``kernel``; its weight is replaced
    by the kernel's layout (the stored one let go)."""
    weight = layer.weight.detach()
    if kernel == "packed":
        product = PackedInt8Product(weight, layer.weight_scale.detach())
        layer.weight, layer.product = product.weight, product
    elif kernel == "fused":
        product = FusedInt8Product(weight, layer.weight_scale.detach())
        layer.weight, layer.product = product.weight, product
    else:
        if kernel == "columns":
            layer.weight = torch.nn.Parameter(weight.t().contiguous().t(), requires_grad=False)
        layer.product = int8_product_on_cpu


def available_kernels() -> tuple[str, ...]:
    """The kernels of :data:`KERNELS` this machine and torch build run."""
    fused = native_operator("int8_panels_linear") is not None
    return tuple(kernel for kernel in KERNELS
                 if (kernel != "packed" or _packing_works()) and (kernel != "fused" or fused))


@functools.cache
def _packing_works() -> bool:
    """Whether this torch build has oneDNN's int8 product and it gives ``_int_mm``'s values."""
    if not torch.backends.mkldnn.is_available():
        return False
    weight, scales = quantize_rows(torch.linspace(-1, 1, 32 * 16).reshape(32, 16))
    x = torch.linspace(1, -3, 3 * 16).reshape(3, 16)
    try:
        packed = PackedInt8Product(weight, scales)(x, weight, scales)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return torch.equal(packed, int8_product_on_cpu(x, weight, scales))
