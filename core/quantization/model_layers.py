"""The linear layers of a model, split by tensor parallelism or whole, made weight-only int8
(``accelgen.quantization.int8_layer``) on each rank after loading: each rank quantizes only its own slices.

A column-parallel layer holds whole output rows, quantized as one process quantizes them. A row-parallel
layer holds a slice of every row: its ranks agree on each row's largest magnitude first, so every rank's
values and scales are the ones a single process gives that slice, and the outputs of any world size match
the single process's up to the order of the all-reduce's additions (as unquantized tensor parallelism does).
The output head and the embeddings keep the run's dtype by default, as bitsandbytes' and DeepSpeed's int8 do: they
are a small share of a large model and the logits are the most sensitive to rounding. A device may ask for the head
in int8 too where it holds a weight of its own (:func:`accelgen.model.shape.own_head_name`), as CTranslate2 and
OpenVINO quantize it: in a small model decoding one row it is a large share of the bytes read per token.

A pre-quantized checkpoint (``accelgen shard --quantize int8``) is loaded into :func:`empty_int8_layers`, whose
int8 weights and scales are then filled from its files: the full-precision weights are never read.
"""

from __future__ import annotations

import torch

from accelgen.common.errors import UsageError
from accelgen.model.shape import own_head_name
from accelgen.parallel.deepspeed_adapter import row_parallel_largest, row_parallel_sum, split_linear_kind
from accelgen.quantization.int8_layer import Int8Linear, Int8Product, int8_product, quantize_rows
from accelgen.quantization.while_loading import SCALE_SUFFIX


def int8_layers(model: torch.nn.Module, head: bool = False) -> dict[str, str]:
    """The layers int8 applies to, by name: their kind ("whole", "column" or "row"), in the model's order; with
    ``head``, the output head too where it holds a weight of its own (:func:`accelgen.model.shape.own_head_name`)."""
    output_embeddings = model.get_output_embeddings()
    layers = {name: kind for name, module in model.named_modules()
              if module is not output_embeddings and (kind := _kind(module))}
    if head and (name := own_head_name(model)):
        layers[name] = "whole"
    return layers


def quantize_linear_layers(model: torch.nn.Module, product: Int8Product, head: bool = False) -> torch.nn.Module:
    """``model`` with every linear layer but the output head (with ``head``, that too where it holds a weight of its
    own) replaced by an :class:`Int8Linear` computing with ``product``, one layer at a time (the memory of one layer's
    weight is all it adds while it works); layers already int8 (a pre-quantized checkpoint) are given ``product``."""
    already = [module for module in model.modules() if isinstance(module, Int8Linear)]
    for module in already:
        module.product = product
    layers = int8_layers(model, head)
    if not layers and not already:
        raise UsageError(f"--quantize int8 finds no linear layers to quantize in this {model.config.model_type} model "
                         f"(its layers are of another kind): drop --quantize.")
    for name, kind in layers.items():
        quantize_layer(model, name, kind, product)
    return model


def holds_int8_head(model: torch.nn.Module, weights) -> bool:
    """Whether pre-quantized ``weights`` (``accelgen shard --quantize int8``) hold ``model``'s output head in int8:
    folders written for a device whose int8 quantizes the head do (``Accelerator.tuning.int8_quantizes_head``)."""
    name = own_head_name(model)
    if name is None:
        return False
    try:
        weights.shape(f"{name}.weight{SCALE_SUFFIX}")
    except UsageError:
        return False
    return True


def quantize_layer(model: torch.nn.Module, name: str, kind: str, product: Int8Product = int8_product) -> Int8Linear:
    """Replace the linear layer ``name`` (of ``kind``, see :func:`int8_layers`) by its int8 form; its
    full-precision weight is let go. A row-parallel layer's ranks must call this together."""
    module = model.get_submodule(name)
    weight = module.weight.detach()
    largest = None
    if kind == "row":
        largest = weight.abs().amax(dim=1).float()
        row_parallel_largest(module, largest)
    values, scales = quantize_rows(weight, largest)
    return _replace(model, name, kind, values, scales, product)


def empty_int8_layers(model: torch.nn.Module, head: bool = False) -> None:
    """Replace every layer int8 applies to (``head``: see :func:`int8_layers`) by an :class:`Int8Linear` of the same
    shape whose weights and scales are allocated, not filled (the layer's full-precision weight is let go), for a
    pre-quantized checkpoint or weights quantized as they are read."""
    for name, kind in int8_layers(model, head).items():
        weight = model.get_submodule(name).weight
        values = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        scales = torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device)
        _replace(model, name, kind, values, scales, int8_product)


def _replace(model: torch.nn.Module, name: str, kind: str, values: torch.Tensor, scales: torch.Tensor,
             product: Int8Product) -> Int8Linear:
    """Put an :class:`Int8Linear` of ``values`` and ``scales`` in the stead of the layer ``name`` (keeping its
    bias, and a row-parallel layer's sum over its ranks); the layer's full-precision weight is let go."""
    module = model.get_submodule(name)
    all_reduce = row_parallel_sum(module) if kind == "row" else None
    layer = Int8Linear(values, scales, module.bias, product, all_reduce)
    model.set_submodule(name, layer)
    del module.weight
    return layer


def _kind(module: torch.nn.Module) -> str | None:
    if type(module) is torch.nn.Linear:
        return "whole"
    return split_linear_kind(module)
