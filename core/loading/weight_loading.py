"""A model's weights put in place part by part: the skeleton (``accelgen.model.empty_model``) is given memory on
its device (the whole model at one rank; each rank's slices, allocated by DeepSpeed, under tensor
parallelism), then each parameter is filled from a weight source (``accelgen.loading.weight_sources``) with only
the part of the tensor this rank holds. Host memory holds one tensor's part at a time, never the model.

Which part a rank holds is read from the shapes DeepSpeed gave the ranks' parameters: a parameter whose
shape differs from the checkpoint tensor's in one dimension holds, along it, the rows after those of the
lower ranks. That is exact for splits into contiguous blocks, which the families in
``accelgen.model.architectures`` are checked to make.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Callable

import torch

from accelgen.common.errors import UsageError
from accelgen.common.settings import World
from accelgen.loading.aligned_safetensors import ALIGNMENT
from accelgen.loading.finite_values import finite_flag, refuse_not_finite, values_are_read
from accelgen.loading.weight_sources import TensorPart
from accelgen.parallel.process_groups import gather_from_ranks

#: Host memory.
HOST = torch.device("cpu")

#: Parameters filled at once: reading a part into fresh memory costs a page fault per page, which threads
#: overlap (the reads release the interpreter lock). Mapped parts cost next to nothing either way.
READ_THREADS = min(4, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class ParameterLoad:
    """Parameter ``name`` holds ``part`` of the source's tensor of that name (None: all of it)."""

    name: str
    part: TensorPart | None


def load_weights(
    skeleton: torch.nn.Module, source, world: World, device: torch.device,
    shard: Callable[[torch.nn.Module], torch.nn.Module] | None = None, whole_tensors: bool = False,
    before_filling: Callable[[torch.nn.Module], None] | None = None,
) -> torch.nn.Module:
    """The model with its weights from ``source``: the empty ``skeleton`` split by ``shard`` (tensor
    parallelism) or put whole on ``device``, then filled. ``whole_tensors``: the source holds exactly this
    rank's tensors (a pre-sharded checkpoint). ``before_filling``: what gives the allocated model the form of
    the source's tensors (int8 layers for a pre-quantized checkpoint)."""
    model = allocate(skeleton, device, shard)
    if before_filling is not None:
        before_filling(model)
    fill_parameters(model, source, plan_loading(model, source, world, whole_tensors))
    return model


def allocate(skeleton: torch.nn.Module, device: torch.device,
             shard: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
             modules_on: dict[str, torch.device] | None = None) -> torch.nn.Module:
    """The empty model with memory for its parameters (not filled): split by ``shard``, or whole on ``device``,
    or (``modules_on``: module or parameter name -> device) only those, each on its device, the rest left
    empty (offloaded). Buffers keep their values (allocating gives every tensor new, unset memory)."""
    buffers = {name: buffer.clone() for name, buffer in skeleton.named_buffers()}
    if shard is not None:
        model = shard(skeleton)
    elif modules_on is None:
        model = skeleton.to_empty(device=device)
    else:
        model = skeleton
        for name, module_device in modules_on.items():
            _allocate_part(model, name, module_device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # to_empty gives tied parameters memory of their own
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])
    return model


def _allocate_part(model: torch.nn.Module, name: str, device: torch.device) -> None:
    """Memory on ``device`` for the module called ``name`` (every parameter in it), or the parameter so called."""
    try:
        model.get_submodule(name).to_empty(device=device)
    except AttributeError:
        owner_name, _, attribute = name.rpartition(".")
        owner, parameter = model.get_submodule(owner_name), model.get_parameter(name)
        owner.register_parameter(attribute, torch.nn.Parameter(torch.empty_like(parameter, device=device),
                                                               requires_grad=parameter.requires_grad))


def plan_loading(model: torch.nn.Module, source, world: World, whole_tensors: bool = False) -> list[ParameterLoad]:
    """What each of this rank's parameters reads (every rank must call this: the ranks' shapes are gathered)."""
    own_shapes = {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}
    shapes_by_rank = gather_from_ranks(own_shapes, world)
    plan = []
    for name in own_shapes:
        full_shape = source.shape(name)
        rank_shapes = [shapes[name] for shapes in shapes_by_rank]
        if whole_tensors and full_shape != own_shapes[name]:
            raise UsageError(
                f"Tensor {name!r} of {source.where} has shape {list(full_shape)} where this rank's model has "
                f"{list(own_shapes[name])}: the folder was sharded by another DeepSpeed release or accelgen; "
                f"shard the model again with this one (accelgen shard)."
            )
        plan.append(ParameterLoad(name, rank_part(name, full_shape, rank_shapes, world.rank)))
    return plan


def rank_part(name: str, full_shape: tuple[int, ...], rank_shapes: list[tuple[int, ...]], rank: int) -> TensorPart | None:
    """The part of a ``full_shape`` tensor that rank ``rank`` holds, the ranks' parameters having
    ``rank_shapes``: None when it holds all of it."""
    own = rank_shapes[rank]
    if own == full_shape:
        return None
    split_dims = [dim for dim in range(len(own)) if len(own) == len(full_shape) and own[dim] != full_shape[dim]]
    if len(split_dims) != 1 or sum(shape[split_dims[0]] for shape in rank_shapes) < full_shape[split_dims[0]]:
        raise ValueError(f"{name}: ranks hold {rank_shapes} of a {list(full_shape)} tensor, not blocks of one dimension")
    dim = split_dims[0]
    start = sum(shape[dim] for shape in rank_shapes[:rank])
    return TensorPart(dim, start, max(0, min(own[dim], full_shape[dim] - start)))


#: Dtypes whose tensors are used as maps of their files only where the map gives them aligned memory (on
#: ``ALIGNMENT`` bytes): quantized kernels load them with aligned vector instructions (torch's CPU int8 kernel
#: faults on a weight not 16-byte aligned). Elsewhere they are read into the model's own memory, which the
#: allocator aligns. ``accelgen shard --quantize`` writes them aligned (``accelgen.loading.aligned_safetensors``).
ALIGNED_ONLY = (torch.int8,)


def fill_parameters(model: torch.nn.Module, source, plan: list[ParameterLoad]) -> None:
    """Give each planned parameter its part of ``source``, a few at a time (reads and page faults overlap;
    at most ``READ_THREADS`` tensors' parts are in flight). A part the source holds in one piece in host
    memory of the parameter's dtype (a memory-mapped file) becomes the parameter's memory, uncopied; any
    other is copied in, converted and moved. Rows past the tensor's end (the last rank's padding of a
    vocabulary) are zero. Each part filled from a checkpoint is checked to hold finite values where it now is
    (``accelgen.loading.finite_values``): UsageError naming the first that does not, once all are filled."""
    parameters = dict(model.named_parameters())
    checked = values_are_read(source)
    flags: dict[str, torch.Tensor | None] = dict.fromkeys(load.name for load in plan)

    @torch.no_grad()  # in each thread: grad mode is per thread
    def fill(load: ParameterLoad) -> None:
        parameter = parameters[load.name]
        destination = parameter.data
        if load.part is not None and load.part.length < destination.shape[load.part.dim]:
            destination.zero_()
            source.copy_into(destination.narrow(load.part.dim, 0, load.part.length), load.name, load.part)
        else:
            _fill_whole(parameter, source, load)
        if checked:
            flags[load.name] = finite_flag(parameter.data)

    with concurrent.futures.ThreadPoolExecutor(READ_THREADS) as pool:
        for _ in pool.map(fill, plan):  # in order, so the first error is raised
            pass
    if checked:
        refuse_not_finite(source, flags)


def _fill_whole(parameter: torch.nn.Parameter, source, load: ParameterLoad) -> None:
    """Fill ``parameter`` with its part of ``source`` (as long as the parameter): the source's own memory where it
    can be, else a copy."""
    destination = parameter.data
    view = source.view(load.name, load.part)
    if view is not None and destination.dtype in ALIGNED_ONLY and view.data_ptr() % ALIGNMENT:
        view = None
    if view is None:
        source.copy_into(destination, load.name, load.part)
    elif view.device == destination.device and view.dtype == destination.dtype:
        parameter.data = view
    else:
        destination.copy_(view)
