"""The linear layers of a model, split by tensor parallelism or whole, made weight-only int8
(``accelgen.model.int8_weights``) on each rank after loading: each rank quantizes only its own slices.

A column-parallel layer holds whole output rows, quantized as one process quantizes them. A row-parallel
layer holds a slice of every row: its ranks agree on each row's largest magnitude first, so every rank's
values and scales are the ones a single process gives that slice, and the outputs of any world size match
the single process's up to the order of the all-reduce's additions (as unquantized tensor parallelism does).
The output head and the embeddings keep the run's dtype, as bitsandbytes' and DeepSpeed's int8 do by default:
they are a small share of a large model and the logits are the most sensitive to rounding.
"""

from __future__ import annotations

import torch

from accelgen.model.int8_weights import Int8Linear, Int8Product, quantize_rows
from accelgen.parallel.deepspeed_adapter import row_parallel_largest, row_parallel_sum, split_linear_kind


def quantize_linear_layers(model: torch.nn.Module, product: Int8Product) -> torch.nn.Module:
    """``model`` with every linear layer but the output head replaced by an :class:`Int8Linear` computing with
    ``product``, one layer at a time (the memory of one layer's weight is all it adds while it works)."""
    head = model.get_output_embeddings()
    layers = [(name, module, _kind(module)) for name, module in model.named_modules() if module is not head]
    for name, module, kind in layers:
        if kind is None:
            continue
        weight = module.weight.detach()
        largest, all_reduce = None, None
        if kind == "row":
            largest = weight.abs().amax(dim=1).float()
            row_parallel_largest(module, largest)
            all_reduce = row_parallel_sum(module)
        values, scales = quantize_rows(weight, largest)
        model.set_submodule(name, Int8Linear(values, scales, module.bias, product, all_reduce))
        del module.weight
    return model


def _kind(module: torch.nn.Module) -> str | None:
    if type(module) is torch.nn.Linear:
        return "whole"
    return split_linear_kind(module)
