"""``accelgen shard``: a model split once for a world size and dtype and written as a pre-sharded
checkpoint (``accelgen.loading.pre_sharded``), which each rank of later runs reads without slicing.

The job is a tensor-parallel load like a run's, on whatever device the user names (the split depends on
the world size, not on the device): each rank gives memory to its parameters a file's worth at a time,
fills them from the checkpoint, writes them and lets them go, so a rank holds at most one file's worth of
weights. Everything is written into ``<output>.partial`` (the staging folder); rank 0 adds config, tokenizer
and, last, the manifest, then renames the folder to ``<output>``. A job that does not complete (a full disk, a
failed rank, Ctrl-C) has its ``.partial`` folder removed by the user's own process once no rank runs
(:func:`remove_staging_left`); a job killed outright leaves only that folder, which nothing takes for a model and
the next run removes.

The job deletes only what it wrote: the staging folder holds a marker file (``STAGING_MARKER``) from its first
moment, and a ``.partial`` folder without one is the user's and refused; ``--overwrite`` replaces only a folder
``accelgen shard`` wrote (it holds a manifest) or an empty one, never one holding the model being sharded; the
folder replaced is moved into a fresh hidden folder of its own before it is removed. Each rank file's metadata
names its rank and world size (``accelgen.loading.pre_sharded.rank_metadata``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile

import torch

from accelgen.common.errors import UsageError, reason, user_errors
from accelgen.common.groups import consecutive_groups
from accelgen.common.settings import World
from accelgen.loading.aligned_safetensors import save_aligned
from accelgen.loading.model_source import refuse_unsliced_family
from accelgen.loading.pre_sharded import MANIFEST, rank_file_name, rank_metadata, write_manifest
from accelgen.loading.weight_loading import ParameterLoad, allocate, fill_parameters, plan_loading
from accelgen.model.memory import parameter_bytes
from accelgen.parallel.process_groups import gather_from_ranks, init_process_group, wait_for_every_rank
from accelgen.quantization.model_layers import int8_layers, quantize_layer
from accelgen.session.request import Request

STAGING_SUFFIX = ".partial"
#: The file that marks a staging folder as this job's kind (so a later job may remove it).
STAGING_MARKER = ".accelgen-shard-staging"


def output_folder(output: str) -> str:
    """The folder ``--output`` names, as an absolute path (``out/`` and ``out`` are one folder)."""
    return os.path.abspath(output)


def check_shard_request(request: Request, output: str, overwrite: bool) -> None:
    """Raise UsageError for a shard job that cannot work, or would delete what it did not write, before any
    rank starts."""
    if request.model.random_weights:
        raise UsageError("accelgen shard writes a checkpoint's weights: pass --model, not random weights.")
    if request.model.pre_sharded_manifest is not None:
        raise UsageError(f"{request.model.name!r} is already pre-sharded: shard the original model.")
    refuse_unsliced_family(request.model.config())
    folder = output_folder(output)
    staging = folder + STAGING_SUFFIX
    _refuse_the_models_folder(request, output, (folder, staging))
    if os.path.lexists(folder):
        if not overwrite:
            raise UsageError(f"--output {output!r} exists: pass --overwrite to replace it, or another --output.")
        if not os.path.isdir(folder):
            raise UsageError(f"--output {output!r} is a file, not a folder: pass a folder path.")
        with user_errors(f"Cannot read --output {output!r}", "pass another --output"):
            if not _written_by_shard(folder):
                raise UsageError(f"--output {output!r} is a folder accelgen shard did not write (it has no {MANIFEST}): "
                                 f"--overwrite replaces only a pre-sharded folder or an empty one; pass another --output.")
    if os.path.lexists(staging) and not _is_staging(staging):
        raise UsageError(f"{staging!r} exists and accelgen shard did not make it (it is the name the job writes into "
                         f"first): move it away, or pass another --output.")
    _check_writable(os.path.dirname(folder), output)


def _refuse_the_models_folder(request: Request, output: str, folders: tuple[str, ...]) -> None:
    """Raise UsageError when one of ``folders`` (the output and its staging folder) is, or holds, the local
    folder of the model being sharded: replacing it would delete the model."""
    if request.model.local_folder is None:
        return
    model = os.path.realpath(request.model.location)
    for folder in map(os.path.realpath, folders):
        if os.path.commonpath([model, folder]) == folder:
            raise UsageError(f"--output {output!r} holds the model being sharded ({request.model.location!r}): "
                             f"replacing it would delete the model; pass another --output.")


def _written_by_shard(folder: str) -> bool:
    """Whether ``folder`` is one ``accelgen shard`` may replace: a folder it wrote (with a manifest), or empty."""
    return os.path.isfile(os.path.join(folder, MANIFEST)) or not os.listdir(folder)


def _is_staging(path: str) -> bool:
    """Whether ``path`` is a staging folder a shard job made (a real folder, not a link, holding the marker)."""
    return not os.path.islink(path) and os.path.isdir(path) and os.path.isfile(os.path.join(path, STAGING_MARKER))


def _check_writable(parent: str, output: str) -> None:
    """Raise UsageError unless a folder can be made in ``parent`` (tried: permissions alone do not tell, /proc
    or a read-only mount refuse even root)."""
    if not os.path.isdir(parent):
        raise UsageError(f"Cannot write --output {output!r}: {parent!r} is not a writable folder; create it or pass another.")
    with user_errors(f"Cannot write --output {output!r}", "pass a folder you can write to"):
        os.rmdir(tempfile.mkdtemp(prefix=".accelgen-shard-probe-", dir=parent))


def shard_model(request: Request, output: str, max_file_bytes: int) -> int:
    """Write this rank's files of the pre-sharded checkpoint; rank 0 completes and renames the folder.
    Returns how many files the job wrote (on rank 0; the others return how many they wrote)."""
    accelerator, world, dtype = request.accelerator, request.world, request.run.dtype
    device = accelerator.setup(world)
    init_process_group(world, accelerator.dist_backend)
    folder = output_folder(output)
    staging = folder + STAGING_SUFFIX
    if world.is_main:
        with _writing(staging, world):
            _make_staging(staging)
    wait_for_every_rank()
    opened = request.model.open(dtype, world)
    unsharded_bytes = parameter_bytes(opened.skeleton)
    shard = (lambda model: accelerator.shard(model, world, request.run)) if world.size > 1 else None
    model = allocate(opened.skeleton, device, shard)
    plan = plan_loading(model, opened.weights, world)
    quantized = int8_layers(model, accelerator.tuning.int8_quantizes_head) if request.run.quantize else {}
    written = _write_in_files(model, opened.weights, plan, staging, world, max_file_bytes, quantized)
    files_by_rank = gather_from_ranks(written, world)
    if world.is_main:
        source = {"model": request.model.report_name, "identity": request.model.identity(),
                  "unsharded_parameter_bytes": unsharded_bytes}
        with _writing(staging, world):
            request.model.config().save_pretrained(staging)
            opened.tokenizer.save_pretrained(staging)
            opened.skeleton.generation_config.save_pretrained(staging)
            write_manifest(staging, world.size, dtype, files_by_rank, source, request.run.quantize)
            _move_into_place(staging, folder)
    wait_for_every_rank()
    return sum(len(files) for files in files_by_rank)


def _make_staging(staging: str) -> None:
    """A fresh staging folder, marked as this job's kind (one a killed job left is removed first)."""
    if os.path.lexists(staging):
        if not _is_staging(staging):  # checked before the job started; made since
            raise UsageError(f"{staging!r} exists and accelgen shard did not make it: move it away, or pass another --output.")
        shutil.rmtree(staging)
    os.makedirs(staging)
    open(os.path.join(staging, STAGING_MARKER), "w").close()


def remove_staging_left(output: str) -> None:
    """Remove the staging folder of ``--output`` that a job which did not complete left behind, giving its disk
    space back. The user's own process calls it once every rank has ended (none writes there any more); only a
    folder a shard job made (holding the marker) is removed. (Ranks started by torchrun by hand have no such
    process: the next job removes what they left.)"""
    staging = output_folder(output) + STAGING_SUFFIX
    if _is_staging(staging):
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _writing(staging: str, world: World):
    """Errors writing the checkpoint (a full disk, a folder that went away) as one line, naming the rank in a job
    of several. The staging folder is left for the user's own process to remove once every rank has ended
    (:func:`remove_staging_left`): removed under another rank's writes, it would make that rank fail too, for a
    reason that misleads."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as error:
        rank = f" (rank {world.rank})" if world.size > 1 else ""
        raise UsageError(f"Cannot write --output {staging.removesuffix(STAGING_SUFFIX)!r}{rank}: {_write_error(error)}: "
                         f"the checkpoint was not written; free space on that disk, or pass another --output, and "
                         f"run again.") from None


def _write_error(error: BaseException) -> str:
    """Why a write failed, in one line: safetensors wraps the system's reason ("I/O error: File too large (os
    error 27)") where Python gives it alone."""
    wrapped = re.search(r"I/O error: (.+?) \(os error \d+\)", str(error))
    return wrapped[1] if wrapped else reason(error)


def _write_in_files(model: torch.nn.Module, weights, plan: list[ParameterLoad], folder: str, world, max_file_bytes: int,
                    quantized: dict[str, str]) -> list[str]:
    """Fill, write and let go of this rank's parameters, a file of at most ``max_file_bytes`` at a time
    (a parameter larger than that gets a file of its own); the names of the files written. The weights of the
    ``quantized`` layers (name: kind, ``accelgen.quantization.model_layers.int8_layers``) are written as int8
    values and their scales (``<layer>.weight_scale``), quantized in plan order on every rank (a row-parallel
    layer's ranks agree on its scales as they go). The int8 weights start on 64-byte boundaries of their files
    (``accelgen.loading.aligned_safetensors``), so runs use them in place."""
    parameters = dict(model.named_parameters())
    names: list[str] = []

    def size_of(load: ParameterLoad) -> int:
        return parameters[load.name].numel() * parameters[load.name].element_size()

    for group in consecutive_groups(plan, size_of, max_file_bytes):
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
        with _writing(folder, world):
            save_aligned({key: tensor.data.contiguous().cpu() for key, tensor in tensors.items()}, os.path.join(folder, name),
                         rank_metadata(world.rank, world.size))
        for tensor in tensors.values():
            tensor.data = tensor.data.new_empty(0)  # its memory goes back
        names.append(name)
    return names


def _move_into_place(staging: str, folder: str) -> None:
    """Rename the complete staging folder to ``folder``. A folder it replaces (with --overwrite) is first moved
    into a fresh hidden folder beside it, made for it, so that removing it removes nothing else."""
    replaced = None
    if os.path.lexists(folder):
        parent, name = os.path.split(folder)
        replaced = tempfile.mkdtemp(prefix=f".{name}.replaced-", dir=parent)
        os.rename(folder, os.path.join(replaced, name))
    try:
        os.rename(staging, folder)
    except OSError:
        if replaced is not None:  # the old folder goes back where it was
            os.rename(os.path.join(replaced, name), folder)
            os.rmdir(replaced)
        raise
    with contextlib.suppress(OSError):
        os.remove(os.path.join(folder, STAGING_MARKER))
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
