"""The named adapters of a run over a loaded model: each adapted layer replaced by a :class:`LoraLinear` with buffers for
``--max-loras`` adapters of the buffers' rank, and any adapter copied into any buffer slot when the scheduler asks (an
adapter not resident is read from its file: no capture is made again, the buffers keep their addresses).

Under tensor parallelism each rank holds the parts of the matrices its layer's split gives it: the rows of B of a
column-parallel layer's outputs, the columns of A of a row-parallel layer's inputs, found as the model's own weights
are (``accelgen.loading.weight_loading.rank_part``: blocks in rank order, their sizes gathered from the ranks).
"""

from __future__ import annotations

from typing import Callable

import torch

from accelgen.adapters.adapter_files import AdapterFiles
from accelgen.adapters.adapter_set import AdapterSet, linear_features
from accelgen.adapters.lora_layer import AdapterRows, LoraLinear, RowParallelParts
from accelgen.common.settings import RunSettings, World
from accelgen.loading.weight_loading import rank_part
from accelgen.loading.weight_sources import TensorPart
from accelgen.parallel.deepspeed_adapter import row_parallel_partial, row_parallel_sum, split_linear_kind
from accelgen.parallel.process_groups import gather_from_ranks
from accelgen.plugin.contract import LinearLayout
from accelgen.quantization.int8_layer import Int8Linear


class ResidentAdapters:
    """The named adapters of ``adapters`` over ``model`` (loaded, prepared and quantized: its layers are replaced
    now), in buffers of ``run.lora.max_loras`` slots laid out by ``lay_out`` (``Accelerator.linear_layout``);
    :class:`accelgen.model.loaded_model.AdapterBuffers`."""

    def __init__(self, model: torch.nn.Module, adapters: AdapterSet, run: RunSettings, world: World,
                 device: torch.device, lay_out: Callable[[torch.Tensor], LinearLayout | None] = lambda weight: None):
        self.adapters = adapters.named
        self.slots = run.lora.max_loras
        self.rows = AdapterRows(self.slots, adapters.rank, run.torch_dtype, device)
        targets = adapters.targets()
        local = {module: _local_features(model.get_submodule(module)) for module in targets}
        by_rank = gather_from_ranks(local, world)
        #: per adapted layer, the part of A's columns (inputs) and of B's rows (outputs) this rank holds (None: all)
        self.parts: dict[str, tuple[TensorPart | None, TensorPart | None]] = {}
        self.layers: dict[str, LoraLinear] = {}
        for module, (in_features, out_features) in targets.items():
            inputs = rank_part(module, (in_features,), [(shapes[module][0],) for shapes in by_rank], world.rank)
            outputs = rank_part(module, (out_features,), [(shapes[module][1],) for shapes in by_rank], world.rank)
            base = model.get_submodule(module)
            self.parts[module] = (inputs, outputs)
            self.layers[module] = LoraLinear(base, self.rows, *local[module], device, _row_parallel_parts(base), lay_out)
            model.set_submodule(module, self.layers[module])

    @property
    def buffer_bytes(self) -> int:
        """Device bytes of this rank's buffers."""
        return sum(buffer.numel() * buffer.element_size() for layer in self.layers.values()
                   for buffer in (layer.lora_a, layer.lora_b))

    def select(self, token_slots: torch.Tensor | None) -> None:
        self.rows.select(token_slots)

    @torch.no_grad()
    def load_into(self, name: str, slot: int) -> None:
        """Copy the adapter ``name`` into buffer slot ``slot`` (1 to ``slots``) of every adapted layer (zeros in the
        layers it leaves alone): this rank's parts, in the run's dtype, its scaling folded into B."""
        adapter: AdapterFiles = self.adapters[name]
        matrices = adapter.matrices()
        for module, layer in self.layers.items():
            if module not in matrices:
                layer.write_slot(slot)
                continue
            a, b = matrices[module]
            inputs, outputs = self.parts[module]
            if inputs is not None:
                a = a.narrow(1, inputs.start, inputs.length)
            if outputs is not None:
                b = b.narrow(0, outputs.start, outputs.length)
            scaled_b = (b.float() * adapter.layers[module].scaling).to(layer.lora_b.dtype)
            layer.write_slot(slot, a.to(layer.lora_a.dtype), scaled_b)


def _local_features(module: torch.nn.Module) -> tuple[int, int]:
    """(in, out) features of this rank's part of a linear layer, whatever module it is now: a Hugging Face linear layer,
    one that states its features (int8, laid out by the device), else a split one, from its weight [out, in]."""
    features = linear_features(module)
    if features is not None:
        return features
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return module.in_features, module.out_features
    return module.weight.shape[1], module.weight.shape[0]


def _row_parallel_parts(module: torch.nn.Module) -> RowParallelParts | None:
    """The parts of a row-parallel layer (DeepSpeed's, or int8 made of one), None for any other."""
    if isinstance(module, Int8Linear):
        return None if module.all_reduce is None else RowParallelParts(module.partial_product, module.all_reduce, module.bias)
    if split_linear_kind(module) == "row":
        return RowParallelParts(row_parallel_partial(module), row_parallel_sum(module), module.bias)
    return None
