"""One LoRA adapter added into the model's weights at load (``--lora PATH`` without a name): every row is then computed
by the adapted model, at no cost per step. The weights become those of PEFT's ``merge_and_unload()``: each adapted
layer's ``W += (B @ A) * scaling`` (transposed for GPT-2's ``Conv1D``, whose weight is stored [in, out]), the product
computed in float32 and rounded to the weight's dtype, as PEFT computes it for weights of 16 bits on the host.

It runs on the weights as loaded, before the device lays them out and before int8 quantizes them (the int8 values are
then the merged model's). Under tensor parallelism each rank adds the part of the product its slice of the weight
holds (rows of B for a column-parallel layer, columns of A for a row-parallel one: ``accelgen.adapters.resident``'s
parts, found the same way).
"""

from __future__ import annotations

import torch

from accelgen.adapters.adapter_files import AdapterFiles
from accelgen.adapters.adapter_set import linear_features
from accelgen.common.settings import World
from accelgen.loading.weight_loading import rank_part
from accelgen.parallel.process_groups import gather_from_ranks


@torch.no_grad()
def merge_adapter(model: torch.nn.Module, adapter: AdapterFiles, world: World) -> None:
    """Add ``adapter`` into the weights of ``model`` (this rank's parts, loaded in the run's dtype), in place."""
    local = {module: _weight_features(model.get_submodule(module)) for module in adapter.layers}
    by_rank = gather_from_ranks(local, world)
    for module, (a, b) in adapter.matrices().items():
        layer = adapter.layers[module]
        inputs = rank_part(module, (layer.in_features,), [(shapes[module][0],) for shapes in by_rank], world.rank)
        outputs = rank_part(module, (layer.out_features,), [(shapes[module][1],) for shapes in by_rank], world.rank)
        if inputs is not None:
            a = a.narrow(1, inputs.start, inputs.length)
        if outputs is not None:
            b = b.narrow(0, outputs.start, outputs.length)
        target = model.get_submodule(module)
        delta = (b.float() @ a.float()) * layer.scaling  # [out, in]
        weight = target.weight
        weight.add_((delta.t() if _stored_in_by_out(target) else delta).to(device=weight.device, dtype=weight.dtype))


def _weight_features(module: torch.nn.Module) -> tuple[int, int]:
    """(in, out) features of this rank's part of a loaded linear layer (its weight, whole or split)."""
    features = linear_features(module)
    return features if features is not None else (module.weight.shape[1], module.weight.shape[0])


def _stored_in_by_out(module: torch.nn.Module) -> bool:
    """Whether the layer's weight is stored [in, out] (GPT-2's Conv1D) rather than [out, in]."""
    return not isinstance(module, torch.nn.Linear) and linear_features(module) is not None
