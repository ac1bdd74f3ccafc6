"""A checkpoint's full-precision weights read as weight-only int8 (``accelgen.quantization.int8_layer``): for a
layer made int8, ``<layer>.weight`` reads as its int8 values and ``<layer>.weight_scale`` as its scales, the
names a pre-quantized checkpoint (``accelgen shard --quantize int8``) holds. Any loader that fills parameters
from a weight source then fills int8 layers too: the offloading loader uses it to keep offloaded layers in int8.

Each layer is quantized whole (one process: no tensor-parallel slices), as ``quantize_layer`` quantizes a whole
layer, so the values are the ones quantizing after loading gives.
"""

from __future__ import annotations

import threading

import torch

from accelgen.quantization.int8_layer import quantize_rows

SCALE_SUFFIX = "_scale"


class QuantizingWeights:
    """``source`` with the weights of ``layers`` (names of int8 layers) read as int8 values and scales, each
    layer's full-precision weight read and quantized once (the half not yet asked for is kept until it is)."""

    def __init__(self, source, layers: set[str], dtype: torch.dtype):
        self._source, self._dtype = source, dtype
        # One lock per weight: fill_parameters reads from several threads, and two threads asking for a layer's
        # values and its scales at once must not both read and quantize its weight.
        self._locks = {f"{layer}.weight": threading.Lock() for layer in layers}
        self._waiting: dict[str, torch.Tensor] = {}  # the values or scales of a layer quantized, not yet asked for

    def _weight_of(self, name: str) -> str | None:
        """The full-precision weight ``name`` comes from, when it is an int8 layer's values or scales."""
        if name in self._locks:
            return name
        weight = name.removesuffix(SCALE_SUFFIX)
        return weight if name.endswith(SCALE_SUFFIX) and weight in self._locks else None

    @property
    def where(self) -> str:
        return self._source.where

    @property
    def drawn_at_random(self) -> bool:
        return getattr(self._source, "drawn_at_random", False)

    def stored_name(self, name: str) -> str:
        """The name the source stores ``name`` under: an int8 layer's scales come from its weight (a NaN or inf in the
        weight makes its row's scale NaN or inf)."""
        name = self._weight_of(name) or name
        return getattr(self._source, "stored_name", lambda stored: stored)(name)

    def shape(self, name: str) -> tuple[int, ...]:
        weight = self._weight_of(name)
        if weight is None or weight == name:
            return self._source.shape(name)
        return self._source.shape(weight)[:1]

    def view(self, name: str, part) -> torch.Tensor | None:
        return None if self._weight_of(name) else self._source.view(name, part)

    def copy_into(self, destination: torch.Tensor, name: str, part) -> None:
        weight = self._weight_of(name)
        if weight is None:
            self._source.copy_into(destination, name, part)
            return
        with self._locks[weight]:
            tensor = self._waiting.pop(name, None)
            if tensor is None:
                full = self._source.view(weight, None)  # the file's own pages where it can: no copy to quantize
                if full is None or full.dtype != self._dtype:
                    full = torch.empty(self._source.shape(weight), dtype=self._dtype)
                    self._source.copy_into(full, weight, None)
                values, scales = quantize_rows(full)
                del full  # a view's map is let go with it
                tensor, other, other_name = (values, scales, weight + SCALE_SUFFIX) if name == weight else (scales, values, weight)
                self._waiting[other_name] = other
        destination.copy_(tensor)
