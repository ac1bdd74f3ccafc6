"""Models larger than the device (``--offload cpu|disk``), through Hugging Face Accelerate's big-model
inference: the one place that calls Accelerate.

Accelerate places the model's layers, in order, on the device until the memory cap is used (less room for
the largest layer to be brought in, which it keeps itself, and, kept here, the KV cache and activations of
one batch), then in host memory ("cpu") or in files ("disk") (``infer_auto_device_map``). Its hooks
(``dispatch_model``) bring each offloaded layer's weights to the device just before the layer runs and let
them go after. accelgen fills the layers that stay as any load does (``accelgen.loading.weight_loading``) and points
Accelerate at the offloaded ones without copying them: the checkpoint's own safetensors files, or, with
``--offload-folder``, files written there once in the run's dtype (the only way for pickle checkpoints and
random weights).

With ``--quantize int8`` the linear layers are made int8 before anything is placed (``empty_int8_layers``), so
the device map is drawn in int8 bytes, the layers kept are filled with int8 values and scales, and the
offloaded ones are int8 too: half the bytes of bfloat16 to keep and to bring in per step. Their values come from
a pre-quantized checkpoint as they are (read in place), or from quantizing the checkpoint's weights layer by
layer (``accelgen.quantization.while_loading``), written once into --offload-folder.

The generation pipeline is unchanged (buckets, static KV cache on the device), but the decode step is not
captured: the hooks move weights in every step, which no graph can replay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping

import torch

from accelgen.common.errors import UsageError
from accelgen.common.groups import consecutive_groups
from accelgen.common.host_memory import system_memory
from accelgen.common.settings import OffloadSettings, RunSettings, torch_dtype
from accelgen.loading.finite_values import finite_flag, refuse_not_finite, values_are_read
from accelgen.loading.weight_loading import HOST, ParameterLoad, allocate, fill_parameters
from accelgen.model.memory import GIB, USABLE_SHARE, bytes_per_sequence, format_size
from accelgen.quantization.model_layers import empty_int8_layers, holds_int8_head, int8_layers
from accelgen.quantization.while_loading import QuantizingWeights


@dataclasses.dataclass
class Placement:
    """Where an offloaded model's weights sit (bytes), and what Accelerate's hooks have brought to the device."""

    mode: str
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    moved_bytes: int = 0
    forward_passes: int = 0

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of weights kept off the device (host memory and disk)."""
        return self.host_bytes + self.disk_bytes

    @property
    def moved_bytes_per_pass(self) -> int | None:
        """Bytes brought to the device per forward pass (a prefill, or one decoded token's step)."""
        return self.moved_bytes // self.forward_passes if self.forward_passes else None

    def record(self) -> dict:
        """The figures for result files and summaries."""
        return {"engine": "accelerate", **dataclasses.asdict(self), "moved_bytes_per_pass": self.moved_bytes_per_pass}

    def describe(self) -> str:
        if not self.offloaded_bytes:
            return (f"offload {self.mode}: all {self.device_bytes / GIB:.2f} GiB of weights fit on the device under "
                    f"--max-device-memory; nothing offloaded")
        where = [f"{self.device_bytes / GIB:.2f} GiB of weights on the device"]
        where += [f"{self.host_bytes / GIB:.2f} GiB in host memory"] if self.host_bytes else []
        where += [f"{self.disk_bytes / GIB:.2f} GiB on disk"] if self.disk_bytes else []
        per_pass = self.moved_bytes_per_pass
        moved = "" if per_pass is None else f", {per_pass / GIB:.2f} GiB moved to the device per forward pass"
        return f"offload {self.mode}: {', '.join(where)}{moved}; decode steps not captured (weights move in every step)"


def check_offload_world(run: RunSettings, world_size: int) -> None:
    """Raise UsageError for --offload in a tensor-parallel job: Accelerate's offloading runs in one process."""
    if run.offload is not None and world_size > 1:
        raise UsageError("--offload runs the model in one process (Accelerate's big-model inference), not with "
                         "--world-size > 1: drop --offload to split the model over the ranks, or run one rank.")


def load_offloaded(skeleton: torch.nn.Module, weights, device: torch.device, run: RunSettings,
                   free_bytes: int | None, device_is_host: bool, pre_quantized: bool = False,
                   int8_head: bool = False) -> tuple[torch.nn.Module, Placement]:
    """The empty ``skeleton`` placed under the run's memory cap, what stays filled from ``weights``, the rest
    left to Accelerate's hooks; and where it all sits. ``free_bytes``: the device's free memory, if known;
    ``device_is_host``: the device computes in host memory (the accelerator's ``shares_host_memory``);
    ``pre_quantized``: ``weights`` already hold int8 layers' values and scales (with ``run.quantize``), the output
    head's where the folder was written so; ``int8_head``: the device's int8 quantizes a head of its own too (one the
    folder holds in full precision is quantized as it is read)."""
    accelerate = _accelerate()
    offload, dtype = run.offload, torch_dtype(run.dtype)
    if offload.mode == "cpu" and device_is_host:
        raise UsageError("--offload cpu keeps offloaded weights in host memory, which is this device's own memory: "
                         "use --offload disk (with --max-device-memory for the memory the run may use).")
    if run.quantize is not None:
        stored_head = pre_quantized and holds_int8_head(skeleton, weights)
        head = int8_head or stored_head
        stored = set(int8_layers(skeleton, stored_head)) if pre_quantized else set()
        if quantized_as_read := set(int8_layers(skeleton, head)) - stored:
            weights = QuantizingWeights(weights, quantized_as_read, dtype)
        empty_int8_layers(skeleton, head)  # on the meta device: int8 shapes, nothing allocated
    cap = _memory_cap(offload, free_bytes)
    reserve = run.batch_size * bytes_per_sequence(skeleton.config, min(run.buckets) + run.max_new_tokens, run.dtype, 1,
                                                  run.prefill_chunk)
    largest_layer, layer_name = _largest_layer(skeleton, dtype)
    minimum = largest_layer + reserve
    if cap < minimum:
        raise UsageError(
            f"--max-device-memory {format_size(cap)} is below the {format_size(minimum)} this run needs on the device: "
            f"its largest layer ({layer_name}, {format_size(largest_layer)}) while it runs, and the KV cache and "
            f"activations of --batch-size {run.batch_size} ({format_size(reserve)}): pass --max-device-memory "
            f"{format_size(minimum, math.ceil)} or more."
        )
    host_budget = int(USABLE_SHARE * system_memory().get("free_bytes", 0)) if offload.mode == "cpu" else 0
    max_memory = {"cpu": cap - reserve} if device_is_host else {0: cap - reserve, "cpu": host_budget}
    device_map = accelerate.infer_auto_device_map(skeleton, max_memory=max_memory, dtype=dtype,
                                                  no_split_module_classes=list(skeleton._no_split_modules or []))
    device_map = {name: str(device) if isinstance(where, int) else where for name, where in device_map.items()}
    if offload.mode == "cpu" and "disk" in device_map.values():
        raise UsageError(f"The weights left off the device do not fit in host memory ({format_size(host_budget)} "
                         f"usable): use --offload disk.")

    model = allocate(skeleton, device, modules_on={name: HOST if where == "cpu" else device
                                                   for name, where in device_map.items() if where != "disk"})
    fill_parameters(model, weights, [ParameterLoad(name, None) for name, parameter in model.named_parameters()
                                     if not parameter.is_meta])
    placement = _placement(model, offload.mode, device)
    offload_index = _offloaded_weights(model, weights, offload, placement, largest_layer)
    with _quiet_accelerate():  # it warns that offloaded parameters are on the meta device: that is the point
        model = accelerate.dispatch_model(
            model, device_map=device_map, main_device=str(device), offload_index=offload_index,
            skip_keys=getattr(model, "_skip_keys_device_placement", None),
        )
    _count_traffic(model, placement, weights if offload.folder is None and placement.disk_bytes else None)
    return model, placement


def _accelerate():
    try:
        import accelerate
    except ImportError:
        raise UsageError("--offload needs Hugging Face Accelerate: pip install 'accelgen[offload]'.") from None
    return accelerate


@contextlib.contextmanager
def _quiet_accelerate():
    logger = logging.getLogger("accelerate")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _memory_cap(offload: OffloadSettings, free_bytes: int | None) -> int:
    if offload.max_device_bytes is not None:
        return offload.max_device_bytes
    if free_bytes is None:
        raise UsageError("This device does not say how much memory it has free: pass --max-device-memory, e.g. 8GiB.")
    return int(USABLE_SHARE * free_bytes)


def _largest_layer(model: torch.nn.Module, dtype: torch.dtype) -> tuple[int, str]:
    """Bytes and name of the largest piece Accelerate brings to the device at once (a block it does not split)."""
    from accelerate.utils import compute_module_sizes, get_max_layer_size

    sizes = compute_module_sizes(model, dtype=dtype)
    size, names = get_max_layer_size(list(model.named_children()), sizes, list(model._no_split_modules or []))
    return size, names[0] if names else "?"


def _placement(model: torch.nn.Module, mode: str, device: torch.device) -> Placement:
    """Bytes of the filled model's parameters by where they sit (tied ones once): on ``device``, elsewhere on
    the host, or not filled (left on disk)."""
    sizes = {"device": 0, "host": 0, "disk": 0}
    for parameter in model.parameters():
        where = "disk" if parameter.is_meta else "device" if parameter.device == device else "host"
        sizes[where] += parameter.numel() * parameter.element_size()
    return Placement(mode, sizes["device"], sizes["host"], sizes["disk"])


def _offloaded_weights(model: torch.nn.Module, weights, offload: OffloadSettings, placement: Placement,
                       group_bytes: int) -> dict | None:
    """Accelerate's index of the weights left on disk: for each, a safetensors file and its name there. The
    checkpoint's own files, read in place; or, with --offload-folder, files written into a new folder there,
    each tensor in its parameter's dtype (the run's, int8 for int8 layers), ``group_bytes`` at a time (the largest
    layer's size: never more in host memory)."""
    names = _names_with_ties(model)
    if not names:
        return None
    dtypes = {name: parameter.dtype for name, parameter in model.named_parameters(remove_duplicate=False)}
    if offload.folder is None:
        if isinstance(weights, QuantizingWeights):
            raise UsageError("--offload disk with --quantize int8 writes the offloaded layers' int8 weights once: pass "
                             "--offload-folder DIR, or offload a folder of `accelgen shard --quantize int8 --world-size 1` "
                             "(read in place).")
        if not getattr(weights, "reads_in_place", False):
            raise UsageError("--offload disk reads offloaded weights in place only from safetensors files, which this "
                             "model does not have: pass --offload-folder DIR to write them there once.")
        locations = {name: weights.location(canonical) for name, canonical in names.items()}
        if None in locations.values():
            raise UsageError("--offload disk reads offloaded weights in place from the checkpoint's files, where this "
                             "model's are stored in parts put together while loading (experts stored one by one): pass "
                             "--offload-folder DIR to write them there once.")
    else:
        folder = _new_offload_folder(offload.folder, placement.disk_bytes)
        weakref.finalize(model, shutil.rmtree, folder, True)  # the run's copy goes with the model
        locations = _write_offloaded(weights, {name: dtypes[name] for name, canonical in names.items() if name == canonical},
                                     folder, group_bytes)
        locations.update({name: locations[canonical] for name, canonical in names.items()})
    return {name: {"safetensors_file": path, "weight_name": key, "dtype": str(dtypes[name]).removeprefix("torch.")}
            for name, (path, key) in locations.items()}


def _write_offloaded(weights, dtypes: dict[str, torch.dtype], folder: str, group_bytes: int) -> dict[str, tuple[str, str]]:
    """Write the tensors named in ``dtypes`` of ``weights``, each in its dtype, as safetensors files in ``folder``,
    each file holding at most ``group_bytes`` (or one tensor), which is all this holds in memory; where each went."""
    from safetensors.torch import save_file

    locations = {}
    sizes = {name: math.prod(weights.shape(name)) * dtype.itemsize for name, dtype in dtypes.items()}
    for number, group in enumerate(consecutive_groups(list(dtypes), sizes.__getitem__, group_bytes)):
        tensors = {}
        for name in group:
            tensors[name] = torch.empty(weights.shape(name), dtype=dtypes[name])
            weights.copy_into(tensors[name], name, None)
        if values_are_read(weights):
            refuse_not_finite(weights, {name: finite_flag(values) for name, values in tensors.items()})
        path = os.path.join(folder, f"offloaded-{number:05d}.safetensors")
        save_file(tensors, path)
        locations.update({name: (path, name) for name in group})
    return locations


def _names_with_ties(model: torch.nn.Module) -> dict[str, str]:
    """Each name of an unfilled (offloaded) parameter -> the first name of that parameter (tied ones share it)."""
    first_names: dict[int, str] = {}
    names = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if parameter.is_meta:
            names[name] = first_names.setdefault(id(parameter), name)
    return names


def _new_offload_folder(parent: str, needed_bytes: int) -> str:
    """A new folder for this run's offloaded weights inside ``parent``, which must be writable and have room."""
    try:
        os.makedirs(parent, exist_ok=True)
        free = shutil.disk_usage(parent).free
        if free < needed_bytes:
            raise UsageError(f"--offload-folder {parent!r} has {format_size(free)} free; the offloaded weights need "
                             f"{format_size(needed_bytes)}: free some space or pass a folder on another disk.")
        return tempfile.mkdtemp(prefix="accelgen-offload-", dir=parent)
    except OSError as error:
        raise UsageError(f"Cannot write --offload-folder {parent!r} ({error.strerror or error}): pass a writable folder.") from None


class _CountedWeights(Mapping):
    """Accelerate's map of offloaded weights, counting the bytes each lookup brings out; with ``read_in_place`` (the
    checkpoint's weight source, and the names already checked), the first lookup of each tensor also checks that it
    holds finite values: offloaded weights read in place are not read while loading."""

    def __init__(self, weights: Mapping, placement: Placement, read_in_place: tuple[object, set[str]] | None):
        self._weights, self._placement, self._read_in_place = weights, placement, read_in_place

    def __getitem__(self, key: str) -> torch.Tensor:
        tensor = self._weights[key]
        self._placement.moved_bytes += tensor.numel() * tensor.element_size()
        if self._read_in_place is not None:
            source, checked = self._read_in_place
            name = getattr(self._weights, "prefix", "") + key  # Accelerate's PrefixedDataset: the module's own names
            if name not in checked:
                refuse_not_finite(source, {name: finite_flag(tensor)})
                checked.add(name)
        return tensor

    def __iter__(self):
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


def _count_traffic(model: torch.nn.Module, placement: Placement, read_in_place_from=None) -> None:
    """Count what the hooks bring to the device, and the forward passes they do it for; with ``read_in_place_from``
    (the weight source whose files offloaded weights are read from in place), check each the first time it is
    read (``_CountedWeights``). Accelerate keeps each module's hook in ``module._hf_hook`` (a SequentialHook holds
    several) and the offloaded weights of an offloading hook in its ``weights_map`` (accelerate 1.x)."""
    checks = (read_in_place_from, set()) if read_in_place_from is not None and values_are_read(read_in_place_from) \
        else None
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for each in getattr(hook, "hooks", [hook]):
            if getattr(each, "offload", False) and getattr(each, "weights_map", None) is not None:
                each.weights_map = _CountedWeights(each.weights_map, placement, checks)

    def count_pass(module, arguments):
        placement.forward_passes += 1

    model.register_forward_pre_hook(count_pass)
