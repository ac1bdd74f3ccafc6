"""Tensor parallelism with DeepSpeed-Inference (AutoTP), shared by every accelerator plugin: the one place
that calls DeepSpeed and works around what it does.

A plugin's ``shard`` hook calls :func:`shard_with_deepspeed` with its own options; the process group is
set up by the core (``accelgen.parallel.process_groups``) with the plugin's ``dist_backend``. DeepSpeed is imported
inside the functions: the CUDA plugin uses upstream DeepSpeed, Gaudi uses Habana's fork.

The model usually arrives empty (its parameters on the meta device, ``accelgen.model.empty_model``): DeepSpeed
then replaces its linear layers by split ones and allocates each rank's slices, empty, on the rank's
device (``init_inference`` does so for a meta model), and the core fills them from the checkpoint
(``accelgen.loading.weight_loading``). For the families in ``accelgen.model.architectures`` the row-parallel layers are
given to DeepSpeed as its injection policy, so the split it makes is the one the checkpoint is sliced by.
"""

from __future__ import annotations

import os

import torch
import transformers

from accelgen.model.architectures import architecture_of, attention_head_counts
from accelgen.model.empty_model import is_empty
from accelgen.common.errors import UsageError
from accelgen.parallel.process_groups import wait_for_every_rank
from accelgen.common.settings import World
from accelgen.parallel.vocab_parallel import split_vocabulary


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


def slices_checkpoints(config: transformers.PretrainedConfig) -> bool:
    """Whether ranks of this family read only their slices of the checkpoint (else each loads the whole
    model and DeepSpeed's own parser splits it)."""
    return architecture_of(config).decoder_layer is not None


def shard_with_deepspeed(model: torch.nn.Module, world: World, dtype: str, **inference_options) -> torch.nn.Module:
    """``model`` split over ``world.size`` ranks by ``deepspeed.init_inference`` (AutoTP): this rank's part.
    An empty model comes back with its parameters allocated, not filled, on the rank's device.

    ``inference_options`` go to ``init_inference`` (e.g. ``replace_with_kernel_inject=True``).
    """
    try:
        import deepspeed
    except ImportError:
        raise UsageError(
            "Tensor parallelism needs DeepSpeed: pip install 'accelgen[deepspeed]' (or your vendor's DeepSpeed build)."
        ) from None
    check_shardable(model.config, world.size)
    # Our vocabulary-parallel embedding and head, put in before DeepSpeed, which leaves them alone: AutoTP
    # would keep the embedding whole on every rank and give the head an untied copy.
    split_vocabulary(model, world)
    options = dict(replace_with_kernel_inject=False, **_injection_policy(model)) | inference_options
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
    return engine.module  # BLOOM's ALiBi bias is sliced per rank where the model is called (accelgen.model.alibi)


def _injection_policy(model: torch.nn.Module) -> dict:
    """``injection_policy={decoder layer class: its row-parallel layers}`` for the families in the table;
    nothing for the others (AutoTP's parser decides, and their checkpoints load whole)."""
    architecture = architecture_of(model.config)
    if architecture.decoder_layer is None:
        if is_empty(model):
            raise ValueError(f"{model.config.model_type} models cannot be split while empty: load them whole")
        return {}
    layer_class = next(type(module) for module in model.modules() if type(module).__name__ == architecture.decoder_layer)
    return {"injection_policy": {layer_class: architecture.row_parallel}}


def prepare_shared_memory_all_reduce(world: World) -> bool:
    """Get DeepSpeed's shared-memory all-reduce kernel (its CPU accelerator's) right; True when it will be
    used. It runs when all ranks share a machine, which DeepSpeed learns from LOCAL_SIZE, set by DeepSpeed's
    launcher but not torch's: without it the kernel runs uninitialised and the rank dies with SIGSEGV
    (DeepSpeed 0.19.8). So: name the local ranks on one node, and turn the kernel off across nodes, where
    gloo's all-reduce is used instead. Its buffers are unlinked once mapped (:func:`_unlink_shared_memory_buffer`)."""
    import deepspeed.ops

    if world.local_size == world.size:
        os.environ["LOCAL_SIZE"] = str(world.local_size)
        return True
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return False


def _unlink_shared_memory_buffer(world: World) -> None:
    """Remove this rank's name of DeepSpeed's shared-memory all-reduce buffer once every rank has mapped it.

    DeepSpeed (0.19.8), when its ranks share a host, creates one 66 MB POSIX shared-memory segment per rank
    while it joins (inside ``init_inference``) and never unlinks it: each job left its buffers in /dev/shm
    (20 GB after a day of tests here). After a barrier every rank has opened every other's segment, so
    the names can go: the mappings stay valid and the memory is freed when the last rank exits. Where
    DeepSpeed made no such buffer (GPUs, several hosts) there is nothing to remove."""
    wait_for_every_rank()
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_"
            f"{os.environ.get('MASTER_PORT')}_{world.rank}")
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass
