"""The static KV cache: Hugging Face's ``StaticCache``, across the transformers releases we support.

transformers >= 4.56 allocates each layer on its first write (so the head count comes from the model
as it runs, tensor-parallel shards and multi-query attention included) and keeps its own write
position in a tensor. transformers 4.55 allocates every layer up front from the config, which gets
the head count wrong for multi-query models (Falcon) and sharded ones, and writes at the
``cache_position`` the model is given: there we size each layer from one probe forward pass.
The helpers below hide those differences from the generation loop.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, StaticCache


def new_static_cache(
    model: torch.nn.Module, batch_size: int, max_cache_len: int, device: torch.device, dtype: torch.dtype
) -> StaticCache:
    """A cache holding ``max_cache_len`` positions for ``batch_size`` rows of ``model``."""
    if "max_cache_len" in inspect.signature(StaticCache.__init__).parameters:
        return StaticCache(config=model.config, max_cache_len=max_cache_len)
    cache = StaticCache(
        config=model.config, max_batch_size=batch_size, max_cache_len=max_cache_len, device=device, dtype=dtype
    )
    for layer, (heads, key_dim, value_dim) in zip(cache.layers, _key_value_shapes(model, device)):
        layer.keys = torch.zeros((batch_size, heads, max_cache_len, key_dim), dtype=dtype, device=device)
        layer.values = torch.zeros((batch_size, heads, max_cache_len, value_dim), dtype=dtype, device=device)
        torch._dynamo.mark_static_address(layer.keys)
        torch._dynamo.mark_static_address(layer.values)
    return cache


def _key_value_shapes(model: torch.nn.Module, device: torch.device) -> list[tuple[int, int, int]]:
    """(key/value heads, key dim, value dim) of each layer, read off a one-token forward pass."""
    with torch.no_grad():
        output = model(
            input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), past_key_values=DynamicCache(), use_cache=True
        )
    return [(keys.shape[1], keys.shape[-1], values.shape[-1]) for keys, values in output.past_key_values]


def rewind_static_cache(cache: StaticCache, length: int) -> None:
    """Make the next write land at position ``length``, as if only ``length`` tokens had been written.

    Graph capture may run the decode step to warm up; this undoes its advance of the write position.
    Positions past ``length`` are overwritten before they are attended to, so their content is moot.
    """
    for layer in cache.layers:
        write_position = getattr(layer, "cumulative_length", None)
        if isinstance(write_position, torch.Tensor):
            write_position.fill_(length)
        elif write_position is not None:
            layer.cumulative_length = length
