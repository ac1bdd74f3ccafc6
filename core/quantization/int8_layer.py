"""Weight-only int8: each output channel's weights stored as int8 with one scale (its largest magnitude / 127),
the input and output kept in the run's dtype. Half the bytes of bfloat16 weights, and decoding (which reads
every weight once per token) reads half as much.

The product of an input and an int8 weight is the accelerator's (``Accelerator.quantize`` passes it): a fused
kernel where the device has one. :func:`int8_product` is the plain one any device can run.
"""

from __future__ import annotations

from typing import Callable

import torch

#: ``product(x [rows, in], weight int8 [out, in], scales [out]) -> [rows, out]`` in x's dtype.
Int8Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: Largest int8 magnitude used: symmetric, so -127..127 (-128 is never written).
INT8_LIMIT = 127
#: float32 values :func:`quantize_rows` works on at a time (1 MiB)
QUANTIZED_BLOCK_VALUES = 1 << 18


def int8_product(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` times the int8 ``weight`` scaled per output channel, by plain operations (the weight converted to
    x's dtype for the product)."""
    return (x @ weight.to(x.dtype).t()) * scales


def quantize_rows(weight: torch.Tensor, largest: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as int8 values and one scale per output row (in the weight's dtype). ``largest``: each
    row's largest magnitude when the row is longer than ``weight`` holds (a row-parallel slice: the whole row's,
    so that every rank quantizes its slice as one process quantizes the whole)."""
    if largest is None:  # each row's largest magnitude, with no copy of the weight made for it
        largest = torch.linalg.vector_norm(weight, ord=float("inf"), dim=1).float()
    scales = (largest / INT8_LIMIT).clamp(min=torch.finfo(torch.float32).tiny).to(weight.dtype)
    # a block of rows at a time (about 1 MiB of float32, which the processor's cache holds), divided, rounded and
    # bounded in place: a weight read once from memory (a whole float32 copy, worked on op by op, was read five times
    # over: twice the time), and no temporary the size of the layer
    values = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    divisors = scales.float()[:, None]
    rows = max(1, QUANTIZED_BLOCK_VALUES // max(1, weight.shape[1]))
    block = torch.empty((min(rows, weight.shape[0]), weight.shape[1]), dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], rows):
        part = block[: min(rows, weight.shape[0] - start)]
        part.copy_(weight[start : start + rows]).div_(divisors[start : start + rows]).round_()
        values[start : start + rows].copy_(part.clamp_(-INT8_LIMIT, INT8_LIMIT))
    return values, scales


class Int8Linear(torch.nn.Module):
    """A linear layer with weight-only int8 weights. ``all_reduce`` (in place) sums a row-parallel layer's
    partial outputs over its ranks, before the bias, as the layer it replaces did."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, product: Int8Product,
                 all_reduce: Callable[[torch.Tensor], None] | None = None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scales, requires_grad=False)
        if bias is not None and not isinstance(bias, torch.nn.Parameter):
            bias = torch.nn.Parameter(bias, requires_grad=False)
        self.bias = bias  # the replaced layer's own parameter (so that who holds it still holds the model's)
        self.product, self.all_reduce = product, all_reduce
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def partial_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] times this layer's weights: [..., out], before a row-parallel layer's sum over its ranks and the
        bias."""
        output = self.product(x.reshape(-1, self.in_features), self.weight, self.weight_scale)
        return output.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.partial_product(x)
        if self.all_reduce is not None:
            self.all_reduce(output)
        if self.bias is not None:
            output = output + self.bias
        return output

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"
