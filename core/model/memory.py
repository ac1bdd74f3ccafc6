"""What to try after running out of device memory: a batch size or world size that would fit.

Estimated from the model's shape and the device's total memory (``memory_stats()["total_bytes"]``):
per rank, the weights, then per sequence its KV cache (keys and values of every layer for the cache
length: the generator's one cache, which every bucket shares, sized for the largest bucket met) plus
the activations of a prefill pass (over the prompt bucket, or one chunk of it). The estimate leaves 10% of the
device to the runtime and allocator, so it errs on the side of fitting.
"""

from __future__ import annotations

import math

import torch
import transformers
from transformers import AutoModelForCausalLM

from accelgen.common.errors import UsageError
from accelgen.common.settings import DTYPE_BYTES
from accelgen.model.shape import attention_head_counts, larger_world_sizes, own_head_name

GIB = 1024**3
USABLE_SHARE = 0.9
#: Live activations of a prefill, per token, in units of ``hidden_size`` values (residual, attention and
#: MLP intermediates, with headroom): a coarse, safe-side figure.
ACTIVATION_VALUES_PER_TOKEN = 16


def kv_cache_bytes_per_position(config: transformers.PretrainedConfig, dtype: str, world_size: int) -> int:
    """Bytes of keys and values one position of one row holds on each rank, over every layer."""
    heads, key_value_heads = attention_head_counts(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * (key_value_heads // world_size) * head_dim * DTYPE_BYTES[dtype]


def bytes_per_sequence(config: transformers.PretrainedConfig, cache_length: int, dtype: str, world_size: int,
                       prefill_chunk: int = 0) -> int:
    """Device bytes one more row of the batch costs on each rank: KV cache plus the activations of a prefill pass (of
    the cache length, or of at most ``prefill_chunk`` positions: ``--prefill-chunk``)."""
    kv_cache = kv_cache_bytes_per_position(config, dtype, world_size) * cache_length
    pass_positions = min(cache_length, prefill_chunk) if prefill_chunk else cache_length
    activations = pass_positions * config.hidden_size * ACTIVATION_VALUES_PER_TOKEN * DTYPE_BYTES[dtype] + config.vocab_size * 4
    return kv_cache + activations


def check_cache_fits(
    config: transformers.PretrainedConfig, *, dtype: str, batch_size: int, cache_length: int, world_size: int,
    device_name: str, free_bytes: int | None, device_is_host: bool = False, prefix_store_bytes: int = 0,
    prefill_chunk: int = 0,
) -> None:
    """Raise UsageError before allocating a KV cache larger than the memory free on the device. On a device
    that computes in host memory (``device_is_host``, the CPU) the prefill's activations count too: there an
    allocation too large is granted lazily and the kernel then kills the process without a word, where a
    device's allocator raises an error the run reports. ``prefix_store_bytes``: what the store of prompt prefixes
    will take besides (``--prefix-cache``), not allocated yet; ``prefill_chunk``: the most positions a prefill pass
    runs (``--prefill-chunk``; 0: a whole prompt bucket)."""
    if free_bytes is None:
        return
    store = (f" besides the {prefix_store_bytes / GIB:,.2f} GiB of the prefix store (--prefix-cache SIZE, or 0)"
             if prefix_store_bytes else "")
    free_bytes = max(free_bytes - prefix_store_bytes, 0)
    kv_cache_per_row = kv_cache_bytes_per_position(config, dtype, world_size) * cache_length
    per_row = bytes_per_sequence(config, cache_length, dtype, world_size, prefill_chunk) if device_is_host else kv_cache_per_row
    if per_row * batch_size <= free_bytes:
        return
    fits = [f"--batch-size {free_bytes // per_row} fits"] if free_bytes >= per_row else []
    fits += ["lower --max-new-tokens or --buckets / --max-input-tokens (shorter rows)"]
    wider = None if device_is_host else _world_size_for_cache(config, kv_cache_per_row * world_size, batch_size,
                                                              world_size, free_bytes)
    fits += [f"--world-size {wider} splits the cache enough"] if wider else []
    what = "KV cache and prefill activations" if device_is_host else "KV cache"
    raise UsageError(
        f"The {what} for --batch-size {batch_size} and {cache_length:,} positions per row (prompt bucket + "
        f"--max-new-tokens) need {per_row * batch_size / GIB:,.1f} GiB per device, more than the "
        f"{free_bytes / GIB:,.1f} GiB free on {device_name}{store}: {'; or '.join(fits)}."
    )


def _world_size_for_cache(config: transformers.PretrainedConfig, unsplit_bytes_per_row: int, batch_size: int,
                          world_size: int, free_bytes: int) -> int | None:
    """The smallest larger world size whose ranks each hold a cache share that fits ``free_bytes`` (ranks split the
    key/value heads, so at most as many ranks as those heads), or None when none does."""
    return next((larger for larger in larger_world_sizes(config, world_size)
                 if unsplit_bytes_per_row * batch_size / larger <= free_bytes), None)


def out_of_memory_advice(
    config: transformers.PretrainedConfig, *, dtype: str, batch_size: int, cache_length: int, world_size: int,
    weight_bytes_per_rank: int, total_bytes: int | None, offload_mode: str | None = None, device_is_host: bool = False,
    prefill_chunk: int = 0,
) -> str:
    """One sentence: what fits instead (a batch size, else a world size), from the model and device sizes; and
    with ``offload_mode`` ("cpu" or "disk"), the --offload that keeps what does not fit off the device. On a device
    that computes in host memory (``device_is_host``) more ranks share the same memory: no world size is offered."""
    if not total_bytes:
        return "lower --batch-size or --max-new-tokens" + ("." if device_is_host else
                                                           ", or spread the model over more devices with --world-size.")
    usable = USABLE_SHARE * total_bytes
    per_sequence = bytes_per_sequence(config, cache_length, dtype, world_size, prefill_chunk)
    sizes = (f"the weights take {weight_bytes_per_rank / GIB:.1f} GiB per device of {total_bytes / GIB:.1f} GiB and "
             f"each sequence about {format_size(per_sequence)}")
    weights_that_fit = usable - per_sequence * batch_size
    offload = ""
    if offload_mode is not None and 0 < weights_that_fit < weight_bytes_per_rank:
        where = "host memory" if offload_mode == "cpu" else "files"
        offload = (f"; or --offload {offload_mode} --max-device-memory {format_size(int(usable), math.floor)}, which keeps about "
                   f"{format_size(int(weights_that_fit))} of the weights on the device and the rest in {where} "
                   f"(slower: brought in layer by layer every step)")
    fitting_batch = int((usable - weight_bytes_per_rank) // per_sequence)
    if 1 <= fitting_batch < batch_size:
        return f"{sizes}, so --batch-size {fitting_batch} should fit{offload}."
    unsharded = weight_bytes_per_rank * world_size
    for larger in [] if device_is_host else larger_world_sizes(config, world_size):
        per_rank_sequence = bytes_per_sequence(config, cache_length, dtype, larger, prefill_chunk)
        if unsharded / larger + per_rank_sequence * batch_size < usable:
            return f"{sizes}, so --world-size {larger} should fit (or a smaller --batch-size){offload}."
    return f"{sizes}: this model does not fit these devices{offload or '; use devices with more memory'}."


def format_size(size: int, whole=None) -> str:
    """``size`` in GiB, MiB or KiB (the largest unit it has one of): ``12.50 GiB``, or with ``whole``
    (``math.ceil`` or ``math.floor``) a whole number of them written as an option takes it, ``13GiB``."""
    unit, name = next((unit, name) for unit, name in ((GIB, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
                      if size >= unit or name == "KiB")
    return f"{whole(size / unit)}{name}" if whole else f"{size / unit:.2f} {name}"


def parameter_bytes_of_config(config: transformers.PretrainedConfig, dtype: str, quantize: str | None = None,
                              head: bool = False) -> int:
    """Bytes of the weights ``config`` describes in ``dtype``, counted on the meta device (no memory used). With
    ``quantize`` (an 8-bit scheme), the linear layers but the output head (with ``head``, that too where it is the
    model's own: :func:`accelgen.model.shape.own_head_name`) hold one byte per weight and one ``dtype`` scale per
    output channel, as ``accelgen.quantization.model_layers`` leaves them."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(parameter.numel() for parameter in model.parameters()) * DTYPE_BYTES[dtype]
    if quantize is None:
        return total
    output_head = model.get_output_embeddings()
    quantized_head = model.get_submodule(name) if head and (name := own_head_name(model)) else None
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and (module is not output_head or module is quantized_head):
            total -= module.weight.numel() * DTYPE_BYTES[dtype] - module.weight.numel() - module.out_features * DTYPE_BYTES[dtype]
    return total


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this process holds (a shard, under tensor parallelism); tied ones once."""
    return sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
