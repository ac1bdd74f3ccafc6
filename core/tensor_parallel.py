"""Tensor parallelism with DeepSpeed-Inference (AutoTP), shared by every accelerator plugin.

A plugin's ``shard`` hook calls :func:`shard_with_deepspeed` with its own options; the process group
is set up by the core (:func:`init_process_group`) with the plugin's ``dist_backend``. DeepSpeed is
imported inside the functions: the CUDA plugin uses upstream DeepSpeed, Gaudi uses Habana's fork.
"""

from __future__ import annotations

import os

import torch
import transformers

from accelgen.errors import UsageError
from accelgen.settings import World
from accelgen.vocab_parallel import split_vocabulary


def attention_head_counts(config: transformers.PretrainedConfig) -> tuple[int, int]:
    """(query heads, key/value heads) of a decoder config, across the naming conventions in use."""
    heads = next(getattr(config, name) for name in ("num_attention_heads", "n_head", "num_heads") if hasattr(config, name))
    key_value_heads = getattr(config, "num_key_value_heads", None) or heads
    if config.model_type == "falcon" and not config.new_decoder_architecture:
        key_value_heads = 1 if config.multi_query else heads
    elif config.model_type == "falcon":
        key_value_heads = config.num_kv_heads
    return heads, key_value_heads


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


def init_process_group(world: World, backend: str) -> None:
    """Join this process to the job's process group (a no-op for a single process or when already joined)."""
    if world.size > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=backend, rank=world.rank, world_size=world.size)


def leave_process_group() -> None:
    """Wait for every rank, then tear the process group down, so no rank exits with collectives
    (or the communication threads behind them) still running."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def shard_with_deepspeed(model: torch.nn.Module, world: World, dtype: str, **inference_options) -> torch.nn.Module:
    """``model`` split over ``world.size`` ranks by ``deepspeed.init_inference`` (AutoTP).

    ``inference_options`` go to ``init_inference`` (e.g. ``replace_with_kernel_inject=True``).
    """
    try:
        import deepspeed
    except ImportError:
        raise UsageError(
            "Tensor parallelism needs DeepSpeed: pip install 'accelgen[deepspeed]' (or your vendor's DeepSpeed build)."
        ) from None
    check_shardable(model.config, world.size)
    # Keep the unsharded vocabulary matrices: AutoTP would leave the embedding whole and untie the head.
    input_embedding = model.get_input_embeddings()
    output_head = model.get_output_embeddings()
    split_vocab = isinstance(input_embedding, torch.nn.Embedding) and isinstance(output_head, torch.nn.Linear) and (
        output_head.bias is None
    )
    if split_vocab:
        input_weight, head_weight = input_embedding.weight, output_head.weight
        tied = head_weight.data_ptr() == input_weight.data_ptr()
    options = dict(replace_with_kernel_inject=False) | inference_options
    try:
        engine = deepspeed.init_inference(
            model, tensor_parallel={"tp_size": world.size}, dtype=getattr(torch, dtype), **options
        )
    except AssertionError as error:  # AutoTP states unsupported models with assertions
        raise UsageError(
            f"DeepSpeed cannot shard {type(model).__name__} with AutoTP ({str(error).strip()}); "
            f"run it with --world-size 1."
        ) from None
    _unlink_shared_memory_buffer(world)
    sharded = engine.module
    if split_vocab:
        split_vocabulary(sharded, input_weight, None if tied else head_weight, world)
    return sharded  # BLOOM's ALiBi bias is sliced per rank where the model is called (accelgen.alibi)


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this process holds (a shard, under tensor parallelism); tied ones once."""
    return sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())


def _unlink_shared_memory_buffer(world: World) -> None:
    """Remove this rank's name of DeepSpeed's shared-memory all-reduce buffer once every rank has mapped it.

    DeepSpeed (0.19.8), when its ranks share a host, creates one 66 MB POSIX shared-memory segment per rank
    while it joins (inside ``init_inference``) and never unlinks it: each job left its buffers in /dev/shm
    (20 GB after a day of tests here). After a barrier every rank has opened every other's segment, so
    the names can go: the mappings stay valid and the memory is freed when the last rank exits. Where
    DeepSpeed made no such buffer (GPUs, several hosts) there is nothing to remove."""
    torch.distributed.barrier()
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{world.rank}")
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


def gather_from_ranks(value, world: World) -> list:
    """``value`` from every rank, in rank order (every rank must call this)."""
    if world.size == 1 or not torch.distributed.is_initialized():
        return [value]
    values = [None] * world.size
    torch.distributed.all_gather_object(values, value)
    return values
