"""Where a model's weights are read from, tensor by tensor and slice by slice: safetensors files (memory
mapped: a slice reads only its own bytes), pickle checkpoints (whole files), or seeded random values.

Each source answers two questions about a tensor named by the model's parameter names: its full shape
(``shape``), and the values of one part of it written into a destination (``copy_into``), converted to
the destination's dtype and put on its device. ``accelgen.weight_loading`` decides which part.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import zlib
from typing import Iterable

import torch

from accelgen.errors import UsageError

PICKLE_PATTERNS = ("pytorch_model*.bin", "model*.bin", "*.pt")


@dataclasses.dataclass(frozen=True)
class TensorPart:
    """Rows ``[start, start + length)`` along ``dim`` of a tensor."""

    dim: int
    start: int
    length: int

    def index(self) -> tuple[slice, ...]:
        return (slice(None),) * self.dim + (slice(self.start, self.start + self.length),)


class CheckpointWeights:
    """Tensors of a checkpoint by name; a model's parameter name is looked up as it is, then without (or
    with) the model's base prefix (BLOOM's published checkpoints name ``h.0...`` what the model calls
    ``transformer.h.0...``)."""

    def __init__(self, where: str, tensors: dict, base_model_prefix: str = ""):
        self.where = where
        self._tensors = tensors  # name -> whatever ``_read`` takes
        self._prefix = f"{base_model_prefix}." if base_model_prefix else ""

    def key(self, name: str) -> str:
        for candidate in (name, name.removeprefix(self._prefix), self._prefix + name):
            if candidate in self._tensors:
                return candidate
        raise UsageError(
            f"{self.where} holds no tensor {name!r} (it holds {len(self._tensors)}, e.g. "
            f"{', '.join(sorted(self._tensors)[:3])}): it was saved for another model; pass the model's own folder."
        )

    def names(self) -> Iterable[str]:
        return self._tensors.keys()


class SafetensorsWeights(CheckpointWeights):
    """Safetensors files, memory-mapped: reading a part reads only its bytes."""

    def __init__(self, paths: list[str], base_model_prefix: str = "", where: str | None = None):
        from safetensors import safe_open

        self._files = [safe_open(path, framework="pt") for path in paths]
        tensors = {name: opened for opened in self._files for name in opened.keys()}
        super().__init__(where or os.path.dirname(paths[0]), tensors, base_model_prefix)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[self.key(name)].get_slice(self.key(name)).get_shape())

    def copy_into(self, destination: torch.Tensor, name: str, part: TensorPart | None) -> None:
        key = self.key(name)
        opened = self._tensors[key]
        values = opened.get_tensor(key) if part is None else opened.get_slice(key)[part.index()]
        destination.copy_(values)


class PickleWeights(CheckpointWeights):
    """``.bin`` checkpoints (torch's pickle format): memory-mapped where the file allows, else read whole."""

    def __init__(self, paths: list[str], base_model_prefix: str = ""):
        tensors = {}
        for path in paths:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
                state = torch.load(path, map_location="cpu", weights_only=True)
            tensors.update(state)
        super().__init__(os.path.dirname(paths[0]), tensors, base_model_prefix)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[self.key(name)].shape)

    def copy_into(self, destination: torch.Tensor, name: str, part: TensorPart | None) -> None:
        values = self._tensors[self.key(name)]
        destination.copy_(values if part is None else values[part.index()])


class RandomWeights:
    """Seeded random values for a model built from its config (benchmarks: speed does not depend on the
    values): matrices drawn from N(0, ``std``), vectors ones (norm weights) or zeros (biases). Each part
    is drawn on its own (a rank draws only what it holds), seeded by the tensor's name and the part."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], std: float, seed: int = 0):
        self._shapes, self._std, self._seed = shapes, std, seed

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def copy_into(self, destination: torch.Tensor, name: str, part: TensorPart | None) -> None:
        if destination.dim() == 1:
            destination.fill_(1.0 if name.endswith("weight") else 0.0)
            return
        seed = self._seed * 1_000_003 + zlib.crc32(name.encode()) + (part.start if part else 0)
        try:
            generator = torch.Generator(device=destination.device).manual_seed(seed)
        except (RuntimeError, TypeError):  # a device without generators of its own: drawn on the host
            generator = torch.Generator().manual_seed(seed)
            destination.copy_(torch.empty(destination.shape).normal_(0.0, self._std, generator=generator))
        else:
            destination.normal_(0.0, self._std, generator=generator)


def checkpoint_files(folder: str) -> tuple[list[str], bool]:
    """(weight files of the model in ``folder``, whether they are safetensors); safetensors preferred."""
    from accelgen.checkpoint_files import SAFETENSORS_INDEX

    index = os.path.join(folder, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        import json

        with open(index, encoding="utf-8") as index_file:
            names = sorted(set(json.load(index_file)["weight_map"].values()))
        return [os.path.join(folder, name) for name in names], True
    safetensors = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if safetensors:
        return safetensors, True
    for pattern in PICKLE_PATTERNS:
        pickles = sorted(glob.glob(os.path.join(folder, pattern)))
        if pickles:
            return pickles, False
    raise UsageError(f"Model folder {folder!r} holds no weights (*.safetensors or pytorch_model*.bin): "
                     f"pass a folder made by save_pretrained.")
