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

import copy
import inspect
import math

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer


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
        # a sliding-window layer holds every position too (the mask gives it its window): its rolling buffer of the
        # window's length has one write position for the whole batch, where each slot writes at its own
        cache.layers = [StaticLayer(max_cache_len=max_cache_len) if layer.is_sliding else layer for layer in cache.layers]
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


def write_each_row_at(cache: StaticCache, write_positions: torch.Tensor) -> None:
    """Make every layer of ``cache`` (B rows, made by :func:`new_static_cache`) write row b's keys and values
    of a one-token step at position ``write_positions[b]`` ([B], read at every call), instead of at one
    position for the whole batch, and return the whole cache to attend over."""
    batch_size = cache.accelgen_batch_size
    for layer in cache.layers:
        layer.update = _each_row_update(layer, write_positions, batch_size)


def _each_row_update(layer, write_positions: torch.Tensor, batch_size: int):
    rows = torch.arange(batch_size, device=write_positions.device)  # made once: the step writes row b at its position

    def update(key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states [B, heads, 1, dim] -> the layer's keys and values [B, heads, L, dim]."""
        _give_memory(layer, key_states, value_states, batch_size)
        key_states, value_states = key_states.to(layer.keys.dtype), value_states.to(layer.values.dtype)
        # an indexed write, not a scatter: a compiler writes it in place, where it copied the whole layer for a scatter
        layer.keys[rows, :, write_positions] = key_states[:, :, 0]
        layer.values[rows, :, write_positions] = value_states[:, :, 0]
        return layer.keys, layer.values

    update.accelgen_write_positions = write_positions  # what each_row_write finds
    return update


def each_row_write(cache: object, layer_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Layer ``layer_index`` of ``cache`` as a decode step writes it (:func:`write_each_row_at`): its keys and values
    [B, heads, L, dim] and the positions [B] where the step writes each row's new ones; None for any other cache or
    view (a prefill's), or a layer that has not taken its memory yet. For a device whose own attention writes the
    cache itself."""
    layers = getattr(cache, "layers", None)
    if layers is None or not 0 <= layer_index < len(layers):
        return None
    layer = layers[layer_index]
    write_positions = getattr(layer.update, "accelgen_write_positions", None)
    if write_positions is None or getattr(layer, "keys", None) is None or getattr(layer, "values", None) is None:
        return None
    return layer.keys, layer.values, write_positions


def prompt_rows(cache: StaticCache, slots: torch.Tensor, whole_rows: bool, start: int = 0) -> StaticCache:
    """A view of ``cache`` to prefill k prompts through: the keys and values of the T tokens of prompt i
    [k, heads, T, dim] go to positions [start, start + T) of row ``slots[i]`` ([k], read at every call) of
    ``cache``. The model attends over what the view returns: the rows' positions [0, start + T) (for a model
    given the core's 4D mask of that many keys; with ``start`` 0, the tokens' own keys and values), or the whole
    rows [k, heads, L, dim] (``whole_rows``, for a model that sizes its mask from the cache). A prefill from
    ``start`` > 0 attends to what the rows already hold before it (a stored prefix copied in).

    A layer that takes its memory on first use (transformers >= 4.56) takes it for the cache's B rows: run one
    prefill through a view before capturing anything over the cache (see :func:`needs_first_write`)."""
    return _view_writing_by(cache, lambda layer: _prompt_rows_update(layer, slots, whole_rows, cache.accelgen_batch_size,
                                                                     start))


def _view_writing_by(cache: StaticCache, update_of) -> StaticCache:
    """A view of ``cache`` (its layers' tensors shared) whose layer's ``update`` is ``update_of(layer)``."""
    view = copy.copy(cache)
    view.layers = [copy.copy(layer) for layer in cache.layers]
    for view_layer, layer in zip(view.layers, cache.layers):
        view_layer.update = update_of(layer)
    return view


def _prompt_rows_update(layer, slots: torch.Tensor, whole_rows: bool, batch_size: int, start: int):
    def update(key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        _give_memory(layer, key_states, value_states, batch_size)
        key_states, value_states = key_states.to(layer.keys.dtype), value_states.to(layer.values.dtype)
        length = key_states.shape[2]
        layer.keys.narrow(2, start, length).index_copy_(0, slots, key_states)
        layer.values.narrow(2, start, length).index_copy_(0, slots, value_states)
        if whole_rows:
            return layer.keys.index_select(0, slots), layer.values.index_select(0, slots)
        if start:
            return (layer.keys.narrow(2, 0, start + length).index_select(0, slots),
                    layer.values.narrow(2, 0, start + length).index_select(0, slots))
        return key_states, value_states

    return update


def packed_rows(cache: StaticCache, token_slots: torch.Tensor, token_positions: torch.Tensor) -> StaticCache:
    """A view of ``cache`` to run prompts packed in one row through (``ModelForward.packed_logits``): the keys and
    values of token j [1, heads, N, dim] go to position ``token_positions[j]`` of row ``token_slots[j]`` (each [N]),
    and the model attends over the tokens' own (its mask keeps each prompt to itself)."""
    return _view_writing_by(cache, lambda layer: _packed_rows_update(layer, token_slots, token_positions,
                                                                     cache.accelgen_batch_size))


def _packed_rows_update(layer, token_slots: torch.Tensor, token_positions: torch.Tensor, batch_size: int):
    def update(key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        _give_memory(layer, key_states, value_states, batch_size)
        key_states, value_states = key_states.to(layer.keys.dtype), value_states.to(layer.values.dtype)
        layer.keys[token_slots, :, token_positions] = key_states[0].transpose(0, 1)
        layer.values[token_slots, :, token_positions] = value_states[0].transpose(0, 1)
        return key_states, value_states

    return update


def copy_prompt_rows(cache: StaticCache, sources: torch.Tensor, targets: torch.Tensor, length: int) -> None:
    """Copy positions [0, ``length``) of rows ``sources`` [m] of every layer of ``cache`` to rows ``targets`` [m]:
    a prompt's keys and values, prefilled once, given to each of its samples' rows."""
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            prompt = tensor.narrow(2, 0, length)
            prompt.index_copy_(0, targets, prompt.index_select(0, sources))


class PrefixPool:
    """Stored prompt-prefix blocks on the device: per layer of a cache, keys and values [blocks, heads, T, dim]
    (T tokens a block), in the cache's dtype, this rank's heads. Left unset (a block is read only after it is
    written): on a device that computes in host memory, only the blocks written take memory."""

    def __init__(self, cache: StaticCache, blocks: int, block_tokens: int):
        self.layers = [tuple(torch.empty((blocks, tensor.shape[1], block_tokens, tensor.shape[3]), dtype=tensor.dtype,
                                         device=tensor.device) for tensor in (layer.keys, layer.values))
                       for layer in cache.layers]

    @staticmethod
    def bytes_per_block(cache: StaticCache, block_tokens: int) -> int:
        """What one block takes, over every layer's keys and values."""
        return sum(tensor[0, :, :1].numel() * tensor.element_size() * block_tokens
                   for layer in cache.layers for tensor in (layer.keys, layer.values))

    def move(self, cache: StaticCache, slots: torch.Tensor, firsts: torch.Tensor, places: torch.Tensor,
             into_cache: bool) -> None:
        """Copy m whole blocks between positions [``firsts[j]``, ``firsts[j]`` + T) of cache row ``slots[j]`` and
        block ``places[j]`` (each [m]): into the cache (a stored prefix given to a row), or out of it (a prefilled
        prompt's blocks stored). As copies of whole rows of two views (a block's values, the cache's positions of
        each head), not an index over two dimensions, which copies value by value."""
        indices: dict[tuple[int, ...], torch.Tensor] = {}
        for layer, stored_pair in zip(cache.layers, self.layers):
            for cached, stored in zip((layer.keys, layer.values), stored_pair):
                _, heads, length, size = cached.shape
                if cached.shape not in indices:  # each block's T positions of each head, as rows of [B * heads * L, D]
                    heads_of = torch.arange(heads, device=slots.device)[None, :, None]
                    tokens = torch.arange(stored.shape[2], device=slots.device)
                    indices[cached.shape] = ((slots[:, None, None] * heads + heads_of) * length
                                             + firsts[:, None, None] + tokens).flatten()
                index, positions, blocks = indices[cached.shape], cached.view(-1, size), stored.view(stored.shape[0], -1)
                if into_cache:
                    positions.index_copy_(0, index, blocks.index_select(0, places).view(-1, size))
                else:
                    blocks.index_copy_(0, places, positions.index_select(0, index).view(len(places), -1))


def _give_memory(layer, key_states: torch.Tensor, value_states: torch.Tensor, batch_size: int) -> None:
    """A layer that takes its memory on first use (transformers >= 4.56) takes it now, for ``batch_size`` rows."""
    if not getattr(layer, "is_initialized", True):
        layer.lazy_initialization(key_states[:1, :, :1].expand(batch_size, -1, -1, -1),
                                  value_states[:1, :, :1].expand(batch_size, -1, -1, -1))
        layer.is_initialized = True


def needs_first_write(cache: StaticCache) -> bool:
    """Whether ``cache``'s layers take their memory on their first write (transformers >= 4.56) and have not
    yet: then one step must run through the cache before anything is captured over it."""
    return not all(getattr(layer, "is_initialized", True) for layer in cache.layers)
