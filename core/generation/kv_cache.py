"""The static KV cache: Hugging Face's ``StaticCache``, across the transformers releases we support, with the
memory of a generator's caches held once.

A generator keeps one cache per static shape (prompt bucket), so that each shape's captured graph finds
its cache at the same addresses. Their memory is one :class:`CacheStorage`: per layer, one flat buffer
for keys and one for values, as large as the largest cache in use; every cache views the beginning of
it. Only one batch runs at a time and each starts by resetting its cache, so caches that share memory
never disturb each other, and a generator that meets every bucket holds one cache's worth of memory.

transformers >= 4.56 allocates each layer on its first write (the head count comes from the model as it
runs, tensor-parallel shards and multi-query attention included) and keeps its own write position in a
tensor: there the release initialises the layer as it always does, only with nothing to allocate, and the
layer is then handed its views. transformers 4.55 allocates every layer up front from the config, which
gets the head count wrong for multi-query models (Falcon) and sharded ones, and writes at the
``cache_position`` the model is given: there each layer is sized from one probe forward pass.
"""

from __future__ import annotations

import inspect
import math

import torch
from transformers import DynamicCache, StaticCache


class CacheStorage:
    """The memory behind a generator's caches: ``capacity`` positions of ``batch_size`` rows per layer."""

    def __init__(self, batch_size: int, capacity: int):
        self.batch_size, self.capacity = batch_size, capacity
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}

    def view(self, layer: int, kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed, contiguous ``shape`` [B, heads, L, head_dim] at the start of the layer's ``kind`` ("keys" or
        "values") buffer, allocated for ``capacity`` positions on first use."""
        batch_size, heads, length, head_dim = shape
        if length > self.capacity:
            raise ValueError(f"a cache of {length} positions does not fit a storage of {self.capacity}")
        buffer = self._buffers.get((layer, kind))
        if buffer is None:
            buffer = torch.zeros(batch_size * heads * self.capacity * head_dim, dtype=dtype, device=device)
            self._buffers[(layer, kind)] = buffer
        view = buffer[: math.prod(shape)].view(shape)
        view.zero_()
        return view


def new_static_cache(
    model: torch.nn.Module, max_cache_len: int, dtype: torch.dtype, device: torch.device, storage: CacheStorage
) -> StaticCache:
    """A cache holding ``max_cache_len`` positions for ``storage.batch_size`` rows of ``model``, in ``storage``."""
    batch_size = storage.batch_size
    if "max_cache_len" in inspect.signature(StaticCache.__init__).parameters:
        cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        for index, layer in enumerate(cache.layers):
            _draw_from(storage, index, layer)
        cache.accelgen_batch_size = batch_size
        return cache
    # transformers 4.55 allocates here: one position (0 would read as "unset"), replaced by the storage's views
    cache = StaticCache(config=model.config, max_batch_size=batch_size, max_cache_len=1, device=device, dtype=dtype)
    for index, (layer, (heads, key_dim, value_dim)) in enumerate(zip(cache.layers, _key_value_shapes(model, device))):
        layer.max_cache_len = max_cache_len
        layer.keys = storage.view(index, "keys", (batch_size, heads, max_cache_len, key_dim), dtype, device)
        layer.values = storage.view(index, "values", (batch_size, heads, max_cache_len, value_dim), dtype, device)
        torch._dynamo.mark_static_address(layer.keys)
        torch._dynamo.mark_static_address(layer.values)
    cache.accelgen_batch_size = batch_size
    return cache


def _draw_from(storage: CacheStorage, index: int, layer) -> None:
    """Make a lazily allocated layer (transformers >= 4.56) take its keys and values from ``storage``."""
    initialize = layer.lazy_initialization

    def lazy_initialization(key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        max_cache_len, layer.max_cache_len = layer.max_cache_len, 0
        try:
            initialize(key_states, value_states)  # every attribute set as this release sets it; nothing allocated
        finally:
            layer.max_cache_len = max_cache_len
        batch_size, heads = key_states.shape[:2]
        dtype, device = key_states.dtype, key_states.device
        layer.keys = storage.view(index, "keys", (batch_size, heads, max_cache_len, key_states.shape[-1]), dtype, device)
        layer.values = storage.view(index, "values", (batch_size, heads, max_cache_len, value_states.shape[-1]), dtype, device)
        torch._dynamo.mark_static_address(layer.keys)
        torch._dynamo.mark_static_address(layer.values)

    layer.lazy_initialization = lazy_initialization


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



class RowWrites:
    """Where the slot cache's layers write: in a decode step, each row at its own ``write_positions`` [B] (the
    slot step's buffer); while prompts are prefilled (``prompt_slots`` [k] set), prompt k's keys and values
    into row ``prompt_slots[k]``, positions [0, P)."""

    def __init__(self, write_positions: torch.Tensor):
        self.write_positions = write_positions
        self.prompt_slots: torch.Tensor | None = None


def write_rows_separately(cache: StaticCache, write_positions: torch.Tensor) -> RowWrites:
    """Make every layer of ``cache`` (B rows, made by :func:`new_static_cache`) write each row where the
    returned :class:`RowWrites` says, instead of at one position for the whole batch: the cache of the slot
    step, whose rows hold prompts inserted at different times."""
    rows = RowWrites(write_positions)
    for layer in cache.layers:
        layer.update = _row_update(layer, rows, cache.accelgen_batch_size)
    return rows


def _row_update(layer, rows: RowWrites, batch_size: int):
    def update(key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """A prefill's key_states [k, heads, P, dim] -> themselves (the prompts attend within themselves);
        a decode step's [B, heads, 1, dim] -> the layer's keys and values [B, heads, L, dim]."""
        if not getattr(layer, "is_initialized", True):  # transformers >= 4.56: memory on first use, for B rows
            layer.lazy_initialization(key_states[:1, :, :1].expand(batch_size, -1, -1, -1),
                                      value_states[:1, :, :1].expand(batch_size, -1, -1, -1))
            layer.is_initialized = True
        key_states, value_states = key_states.to(layer.keys.dtype), value_states.to(layer.values.dtype)
        if rows.prompt_slots is not None:
            length = key_states.shape[2]
            layer.keys.narrow(2, 0, length).index_copy_(0, rows.prompt_slots, key_states)
            layer.values.narrow(2, 0, length).index_copy_(0, rows.prompt_slots, value_states)
            return key_states, value_states
        index = rows.write_positions.view(-1, 1, 1, 1)
        layer.keys.scatter_(2, index.expand_as(key_states), key_states)
        layer.values.scatter_(2, index.expand_as(value_states), value_states)
        return layer.keys, layer.values

    return update
