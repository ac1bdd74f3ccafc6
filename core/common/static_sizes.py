"""A tensor's sizes as numbers while a step is traced.

The core's steps have static shapes, and a device may trace each once per shape (``Accelerator.trace_step``). A
tracer hands sizes out as tensors (so that a trace could serve other shapes), and a branch on one of them warns that
the trace keeps its outcome: for a static shape that is what is meant. Code in a step that branches on a size reads it
here, and so warns of nothing; a warning left then means a branch on data.
"""

from __future__ import annotations

import warnings

import torch


def static_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """``tensor.shape`` as numbers, also while a step is traced."""
    if not torch.jit.is_tracing():
        return tuple(tensor.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return tuple(int(size) for size in tensor.shape)
