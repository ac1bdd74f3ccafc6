"""A checkpoint read under the model's own names where transformers renames or fuses its tensors while loading.

transformers 5.x keeps, per family, the conversions from a checkpoint's names to the model's
(``transformers.conversion_mapping``; ``save_pretrained`` writes them back): GPT-NeoX's head is stored as ``embed_out``
where the model calls it ``lm_head``; Mixtral's and Qwen3-MoE's experts are stored one tensor per expert and
projection where the model holds one tensor per layer (the experts stacked, gate and up side by side). accelgen reads
weights itself (memory-mapped, each rank its slices), so it applies the same conversions, with transformers' own
renaming rules and operations: a renamed tensor is read as before under its stored name; a fused one is put together
from its stored tensors, one at a time, as transformers puts it together. Releases without conversions (4.55)
store every tensor under the model's name.
"""

from __future__ import annotations

import copy

import torch

from accelgen.loading.weight_sources import TensorPart


def converted(source, skeleton: torch.nn.Module):
    """``source`` (a checkpoint's weight source) as the model ``skeleton`` (on the meta device) names its tensors:
    itself where the release converts nothing for this model."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
    except ImportError:  # transformers 4.x: no conversions
        return source
    transforms = get_model_conversion_mapping(skeleton)
    if not transforms:
        return source
    converters = [transform for transform in transforms if isinstance(transform, WeightConverter)]
    renamings = [transform for transform in transforms if not isinstance(transform, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    model_names = skeleton.state_dict()
    stored_as: dict[str, str] = {}  # model name -> stored name
    fused: dict[str, tuple[object, dict[str, list[str]]]] = {}  # model name -> (converter, pattern -> stored names)
    for stored in sorted(source.names(), key=dot_natural_key):
        name, pattern = rename_source_key(stored, renamings, converters, skeleton.base_model_prefix, model_names)
        if name not in model_names:
            continue
        if pattern is None:
            if name != stored:
                stored_as[name] = stored
        else:
            converter, parts = fused.setdefault(name, (by_pattern[pattern], {}))
            parts.setdefault(pattern, []).append(stored)
    if not stored_as and not fused:
        return source
    return ConvertedWeights(source, skeleton, stored_as, fused)


class ConvertedWeights:
    """A weight source (``accelgen.loading.weight_sources``) whose tensors are those of ``source`` under other names
    (``stored_as``: model name -> stored name) or put together from several of its tensors by a transformers converter
    (``fused``: model name -> (converter, its source pattern -> the stored names it takes, in transformers' order))."""

    def __init__(self, source, skeleton: torch.nn.Module, stored_as: dict[str, str],
                 fused: dict[str, tuple[object, dict[str, list[str]]]]):
        self.where = source.where
        self._source, self._skeleton, self._stored_as, self._fused = source, skeleton, stored_as, fused
        self._shapes: dict[str, tuple[int, ...]] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._fused:
            return self._source.shape(self._stored(name))
        if name not in self._shapes:  # the converter run on empty tensors of the stored shapes
            self._shapes[name] = tuple(self._fuse(name, lambda stored: torch.empty(
                self._source.shape(stored), device="meta")).shape)
        return self._shapes[name]

    @property
    def reads_in_place(self) -> bool:
        """Whether the tensors are read from safetensors files (which ``location`` names)."""
        return hasattr(self._source, "location")

    def location(self, name: str) -> tuple[str, str] | None:
        """(the file holding the tensor, its name there), or None for a tensor put together from several."""
        return None if name in self._fused else self._source.location(self._stored(name))

    def view(self, name: str, part: TensorPart | None) -> torch.Tensor | None:
        return None if name in self._fused else self._source.view(self._stored(name), part)

    def copy_into(self, destination: torch.Tensor, name: str, part: TensorPart | None) -> None:
        if name not in self._fused:
            self._source.copy_into(destination, self._stored(name), part)
            return

        def read(stored: str) -> torch.Tensor:
            values = torch.empty(self._source.shape(stored), dtype=destination.dtype)
            self._source.copy_into(values, stored, None)
            return values

        values = self._fuse(name, read)
        destination.copy_(values if part is None else values[part.index()])

    def _stored(self, name: str) -> str:
        """The name a tensor that is not put together from several is stored under."""
        return self._stored_as.get(name, name)

    def _fuse(self, name: str, read) -> torch.Tensor:
        """The model's tensor ``name``: its stored tensors (each given by ``read(stored name)``) through its converter's
        operations, as transformers' loading runs them."""
        converter, parts = self._fused[name]
        converter = copy.deepcopy(converter)  # it collects the tensors it is given
        for pattern, stored_names in parts.items():
            for stored in stored_names:
                converter.add_tensor(name, stored, pattern, lambda stored=stored: read(stored))
        values = converter.convert(name, model=self._skeleton, config=self._skeleton.config)
        found = values.get(name, next(iter(values.values())) if len(values) == 1 else None)
        if found is None:
            raise ValueError(f"transformers' conversion for {name} gave {sorted(values)}")
        return found[0] if isinstance(found, list) else found
