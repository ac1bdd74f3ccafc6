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

import contextlib
import io
import logging
import os
import re
import sys
from typing import Callable, Iterator

import torch

from accelgen.common.errors import UsageError
from accelgen.common.settings import World, torch_dtype
from accelgen.model.architectures import architecture_of
from accelgen.model.empty_model import is_empty
from accelgen.model.shape import check_shardable
from accelgen.parallel.vocab_parallel import split_vocabulary

#: What DeepSpeed says on its own that a user of accelgen has no use for (DeepSpeed 0.16 to 0.19): its logger's lines
#: below ERROR (``[2026-11-27 14:07:37,008] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to
#: CPU...`` from every rank at import, AutoTP's notes) and its kernels' builds (``DeepSpeed
#: deepspeed.ops.comm.deepspeed_shm_comm_op built successfully``).
DEEPSPEED_CHATTER = re.compile(r"\[[^\]]*\] \[(DEBUG|INFO|WARNING)\] |DeepSpeed \S+ built successfully$")
#: The name of DeepSpeed's logger (``deepspeed.utils.logging``).
DEEPSPEED_LOGGER = "DeepSpeed"


class _WithoutChatter(io.TextIOBase):
    """A text stream that passes what it is given to standard error, line by line, less DeepSpeed's chatter."""

    def __init__(self):
        super().__init__()
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._pass_on(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self._pass_on(self._partial)
            self._partial = ""
        sys.stderr.flush()

    @staticmethod
    def _pass_on(line: str) -> None:
        if not DEEPSPEED_CHATTER.match(line):
            sys.stderr.write(line)


@contextlib.contextmanager
def deepspeed_quiet() -> Iterator[None]:
    """Inside the block (DeepSpeed's import, its sharding), what DeepSpeed says on its own (:data:`DEEPSPEED_CHATTER`)
    is dropped and the rest of what it writes to the standard output goes to standard error: a run shows only what
    accelgen says, ``accelgen run > file`` captures completions alone, and DeepSpeed's errors still show. Its logger's
    handler, made at its first import, keeps the standard output of that moment (this block's stream); from then on
    the logger passes on errors only."""
    stream = _WithoutChatter()
    try:
        with contextlib.redirect_stdout(stream):
            yield
    finally:
        stream.flush()
        if "deepspeed.utils.logging" in sys.modules:
            logging.getLogger(DEEPSPEED_LOGGER).setLevel(logging.ERROR)


def require_deepspeed(ranks: int, install: str = 'pip install "accelgen[deepspeed]"') -> None:
    """Raise UsageError, naming ``install``, when DeepSpeed cannot be imported here: a job of ``ranks`` tensor-parallel
    ranks needs it (checked without importing it: its import takes seconds)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise UsageError(f"Tensor parallelism (the model split over {ranks} ranks) needs DeepSpeed, which is not installed "
                         f"here: {install} (or run each replica on one rank: --data-parallel equal to --world-size).")


def shard_with_deepspeed(model: torch.nn.Module, world: World, dtype: str, *, host_ranks: int | None = None,
                         **inference_options) -> torch.nn.Module:
    """``model`` split over ``world.size`` ranks by ``deepspeed.init_inference`` (AutoTP): this rank's part.
    An empty model comes back with its parameters allocated, not filled, on the rank's device.

    ``host_ranks``: how many ranks share this host's memory, for a plugin that uses DeepSpeed's CPU
    shared-memory all-reduce, which reads it from ``LOCAL_SIZE`` (set by DeepSpeed's launcher only).
    ``inference_options`` go to ``init_inference`` (e.g. ``replace_with_kernel_inject=True``).
    """
    require_deepspeed(world.size)
    with deepspeed_quiet():
        import deepspeed
    check_shardable(model.config, world.size)
    # Our vocabulary-parallel embedding and head, put in before DeepSpeed, which leaves them alone: AutoTP
    # would keep the embedding whole on every rank and give the head an untied copy.
    split_vocabulary(model, world)
    options = dict(replace_with_kernel_inject=False, **_injection_policy(model)) | inference_options
    if host_ranks is not None:
        os.environ["LOCAL_SIZE"] = str(host_ranks)
    try:
        with deepspeed_quiet():
            engine = deepspeed.init_inference(
                model, tensor_parallel={"tp_size": world.size}, dtype=torch_dtype(dtype), **options
            )
    except AssertionError as error:  # AutoTP states unsupported models with assertions
        raise UsageError(
            f"DeepSpeed cannot shard {type(model).__name__} with AutoTP ({str(error).strip()}); "
            f"run it with --world-size 1."
        ) from None
    return engine.module  # BLOOM's ALiBi bias is sliced per rank where the model is called (accelgen.model.transformers_adapter.alibi)


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


def split_linear_kind(module: torch.nn.Module) -> str | None:
    """"column" for a DeepSpeed AutoTP column-parallel linear layer (whole output rows: a plain linear on this
    rank's rows, fused query-key-value layers included), "row" for a row-parallel one (a slice of every row;
    the partial outputs summed over the ranks), None for any other module (DeepSpeed's head layers, and any
    layer whose forward does more than that, included)."""
    if "deepspeed" not in type(module).__module__:
        return None
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    forward = type(module).forward
    if isinstance(module, LinearAllreduce) and forward is LinearAllreduce.forward:
        return "row"
    if (isinstance(module, LinearLayer) and forward is LinearLayer.forward and not module.gather_output
            and not type(module).tp_overlap_comm):
        return "column"
    return None


def row_parallel_sum(module: torch.nn.Module) -> Callable[[torch.Tensor], None]:
    """What a row-parallel layer does to its partial output: sum it in place over its ranks, as DeepSpeed does
    (its shared-memory kernel where it uses one)."""
    import deepspeed.comm

    group = module.mp_group
    return lambda output: deepspeed.comm.inference_all_reduce(output, group=group)


def row_parallel_partial(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a row-parallel layer computes before its partial outputs are summed over its ranks and its bias is added,
    as DeepSpeed's ``LinearAllreduce`` computes it: x [..., in / N] -> [..., out]."""
    return lambda x: torch.matmul(x, module.weight.transpose(-1, -2))


def row_parallel_largest(module: torch.nn.Module, largest: torch.Tensor) -> None:
    """Replace ``largest`` (per output row, of this rank's slice) by the largest over the layer's ranks, in place."""
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, group=module.mp_group)
