"""A model loaded for generation, as one object: what it is, where it runs, and the facts of its load that
reports and benchmarks read (the generator reads none of them)."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from accelgen.common.settings import World
from accelgen.plugin.contract import Accelerator


class WeightPlacement(Protocol):
    """Where an offloaded model's weights sit, and what moving them has cost (``accelgen.loading.offload``)."""

    moved_bytes: int  # weights brought to the device so far
    forward_passes: int  # forward passes that brought them

    def record(self) -> dict: ...  # for a result file

    def describe(self) -> str: ...  # for the run's summary


class AdapterBuffers(Protocol):
    """LoRA adapters in fixed-size device buffers over the model's layers, each token computed with its own
    (``accelgen.adapters.resident``). Buffer slot 0 is the base model's; adapters go in slots 1 to ``slots``."""

    slots: int  # buffer slots for adapters (--max-loras)
    buffer_bytes: int  # this rank's device bytes of them

    def load_into(self, name: str, slot: int) -> None: ...  # copy the adapter ``name`` into buffer slot ``slot``

    def select(self, token_slots: torch.Tensor | None) -> None: ...  # [rows, tokens]: each token's slot, next pass


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """``model`` (this rank's part of it, prepared for ``accelerator`` on ``device``) and its tokenizer."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    accelerator: Accelerator
    device: torch.device
    world: World
    unsharded_parameter_bytes: int  # the parameters' bytes before any split over ranks
    loading_host_memory: dict[str, int] = dataclasses.field(default_factory=dict)  # this process's, around loading
    placement: WeightPlacement | None = None  # None: not offloaded
    adapters: AdapterBuffers | None = None  # None: no adapters chosen row by row
    kept_weights: str | None = None  # where kept int8 weights came from or went, as a phrase (None: neither)
