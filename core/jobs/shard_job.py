"""``accelgen shard``: a model split once for a world size and dtype and written as a pre-sharded
checkpoint (``accelgen.loading.pre_sharded``), which each rank of later runs reads without slicing.

The job is a tensor-parallel load like a run's, on whatever device the user names (the split depends on
the world size, not on the device): each rank gives memory to its parameters a file's worth at a time,
fills them from the checkpoint, writes them and lets them go, so a rank holds at most one file's worth of
weights. Everything is written into ``<output>.partial``; rank 0 adds config, tokenizer and, last, the
manifest, then renames the folder to ``<output>``: a killed job leaves only the ``.partial`` folder, which
nothing takes for a model and the next run removes.
"""

from __future__ import annotations

import os
import shutil

import torch

from accelgen.common.errors import UsageError
from accelgen.loading.model_source import refuse_unsliced_family
from accelgen.loading.pre_sharded import rank_file_name, write_manifest
from accelgen.loading.weight_loading import ParameterLoad, allocate, fill_parameters, groups_by_bytes, plan_loading
from accelgen.model.memory import parameter_bytes
from accelgen.parallel.launcher import inject_fault_if_asked
from accelgen.parallel.process_groups import gather_from_ranks, init_process_group, wait_for_every_rank
from accelgen.parallel.quantized_layers import int8_layers, quantize_layer
from accelgen.session.request import Request


def check_shard_request(request: Request, output: str, overwrite: bool) -> None:
    """Raise UsageError for a shard job that cannot work, before any rank starts."""
    if request.model.random_weights:
        raise UsageError("accelgen shard writes a checkpoint's weights: pass --model, not random weights.")
    if request.model.pre_sharded_manifest is not None:
        raise UsageError(f"{request.model.name!r} is already pre-sharded: shard the original model.")
    refuse_unsliced_family(request.model.config())
    if os.path.lexists(output) and not overwrite:
        raise UsageError(f"--output {output!r} exists: pass --overwrite to replace it, or another --output.")
    if os.path.exists(output) and not os.path.isdir(output):
        raise UsageError(f"--output {output!r} is a file, not a folder: pass a folder path.")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise UsageError(f"Cannot write --output {output!r}: {parent!r} is not a writable folder; create it or pass another.")


def shard_model(request: Request, output: str, max_file_bytes: int) -> int:
    """Write this rank's files of the pre-sharded checkpoint; rank 0 completes and renames the folder.
    Returns how many files the job wrote (on rank 0; the others return how many they wrote)."""
    accelerator, world, dtype = request.accelerator, request.world, request.run.dtype
    device = accelerator.setup(world)
    init_process_group(world, accelerator.dist_backend)
    staging = f"{output}.partial"
    if world.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    wait_for_every_rank()
    opened = request.model.open(dtype, world)
    unsharded_bytes = parameter_bytes(opened.skeleton)
    shard = (lambda model: accelerator.shard(model, world, request.run)) if world.size > 1 else None
    model = allocate(opened.skeleton, device, shard)
    plan = plan_loading(model, opened.weights, world)
    quantized = int8_layers(model) if request.run.quantize else {}
    written = _write_in_files(model, opened.weights, plan, staging, world, max_file_bytes, quantized)
    inject_fault_if_asked(world)
    files_by_rank = gather_from_ranks(written, world)
    if world.is_main:
        request.model.config().save_pretrained(staging)
        opened.tokenizer.save_pretrained(staging)
        opened.skeleton.generation_config.save_pretrained(staging)
        source = {"model": request.model.report_name, "identity": request.model.identity(),
                  "unsharded_parameter_bytes": unsharded_bytes}
        write_manifest(staging, world.size, dtype, files_by_rank, source, request.run.quantize)
        _move_into_place(staging, output)
    wait_for_every_rank()
    return sum(len(files) for files in files_by_rank)


def _write_in_files(model: torch.nn.Module, weights, plan: list[ParameterLoad], folder: str, world, max_file_bytes: int,
                    quantized: dict[str, str]) -> list[str]:
    """Fill, write and let go of this rank's parameters, a file of at most ``max_file_bytes`` at a time
    (a parameter larger than that gets a file of its own); the names of the files written. The weights of the
    ``quantized`` layers (name: kind, ``accelgen.parallel.quantized_layers.int8_layers``) are written as int8
    values and their scales (``<layer>.weight_scale``), quantized in plan order on every rank (a row-parallel
    layer's ranks agree on its scales as they go)."""
    from safetensors.torch import save_file

    parameters = dict(model.named_parameters())
    names: list[str] = []

    def size_of(load: ParameterLoad) -> int:
        return parameters[load.name].numel() * parameters[load.name].element_size()

    for group in groups_by_bytes(plan, size_of, max_file_bytes):
        fill_parameters(model, weights, group)
        tensors = {}
        for load in group:
            layer, _, kind_of_tensor = load.name.rpartition(".")
            if kind_of_tensor == "weight" and layer in quantized:
                int8_layer = quantize_layer(model, layer, quantized[layer])
                tensors[load.name], tensors[f"{layer}.weight_scale"] = int8_layer.weight, int8_layer.weight_scale
            else:
                tensors[load.name] = parameters[load.name]
        name = rank_file_name(world.rank, world.size, len(names))
        save_file({key: tensor.data.contiguous().cpu() for key, tensor in tensors.items()}, os.path.join(folder, name))
        for tensor in tensors.values():
            tensor.data = tensor.data.new_empty(0)  # its memory goes back
        names.append(name)
    return names


def _move_into_place(staging: str, output: str) -> None:
    """Rename the complete folder to ``output`` (the folder it replaces, with --overwrite, goes after)."""
    replaced = f"{output}.replaced"
    if os.path.lexists(output):
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(output, replaced)
    os.rename(staging, output)
    shutil.rmtree(replaced, ignore_errors=True)
