"""What a model's config says of its shape: its heads (and whether they split over N ranks), how many
positions it attends over, and which arguments its forward pass takes."""

from __future__ import annotations

import inspect

import torch
import transformers

from accelgen.common.errors import UsageError
from accelgen.model.architectures import architecture_of


def attention_head_counts(config: transformers.PretrainedConfig) -> tuple[int, int]:
    """(query heads, key/value heads) of a decoder config, across the naming conventions in use."""
    heads = next(getattr(config, name) for name in ("num_attention_heads", "n_head", "num_heads") if hasattr(config, name))
    count_key_value_heads = architecture_of(config).count_key_value_heads
    if count_key_value_heads is not None:
        return heads, count_key_value_heads(config)
    return heads, getattr(config, "num_key_value_heads", None) or heads


def check_shardable(config: transformers.PretrainedConfig, world_size: int) -> None:
    """Raise UsageError when the model's heads cannot be split evenly over ``world_size`` ranks."""
    heads, key_value_heads = attention_head_counts(config)
    for count, what in ((heads, "attention heads"), (key_value_heads, "key/value heads")):
        if count % world_size:
            divisors = ", ".join(str(size) for size in range(1, count + 1) if count % size == 0)
            raise UsageError(
                f"The model has {count} {what}, which do not split over --world-size {world_size}: "
                f"use a world size that divides {count} ({divisors})."
            )


def larger_world_sizes(config: transformers.PretrainedConfig, world_size: int) -> list[int]:
    """The world sizes above ``world_size`` the model's heads split over evenly (at most its key/value heads)."""
    heads, key_value_heads = attention_head_counts(config)
    return [size for size in range(world_size + 1, key_value_heads + 1) if heads % size == 0 and key_value_heads % size == 0]


def slices_checkpoints(config: transformers.PretrainedConfig) -> bool:
    """Whether ranks of this family read only their slices of the checkpoint (else each loads the whole
    model and DeepSpeed's own parser splits it)."""
    return architecture_of(config).decoder_layer is not None


def context_limit(config: transformers.PretrainedConfig) -> int | None:
    """Most positions the model can attend over, or None when its position encoding has no limit (ALiBi)."""
    for attribute in ("max_position_embeddings", "n_positions"):
        limit = getattr(config, attribute, None)
        if isinstance(limit, int):
            return limit
    return None


def forward_accepts(model: torch.nn.Module, argument: str) -> bool:
    """Whether the model's forward takes ``argument`` by name (BLOOM refuses ``position_ids``)."""
    return argument in inspect.signature(model.forward).parameters


def own_head_name(model: torch.nn.Module) -> str | None:
    """The name of the output head when it is a plain linear layer with a weight of its own: not the input
    embedding's (a tied head is the embedding's matrix, which the embedding lookup needs whole), not split over ranks
    (vocabulary-parallel heads are modules of their own); None otherwise."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.weight is getattr(model.get_input_embeddings(), "weight", None):
        return None
    return next(name for name, module in model.named_modules() if module is head)
