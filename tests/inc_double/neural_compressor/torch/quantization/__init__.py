"""Test double of ``neural_compressor.torch.quantization``'s FP8 API: not Intel's software (see the README)."""

import json
import math
import os

import torch

#: The allow list's class names that accelgen's models hold (INC's FP8 white list has many more).
PATCHED_TYPES = ("Linear", "LinearLayer", "LinearAllreduce")
#: Largest E4M3 magnitude the card uses, by generation prefix of the device name.
FP8_MAX = {"GAUDI3": 448.0, "GAUDI2": 240.0}


def _record(name, count=1):
    try:
        from habana_frameworks.torch import double_record
    except ImportError:
        return
    double_record[name] += count


class FP8Config:
    """The keyword arguments of INC's FP8Config that a caller sets; ``mode`` AUTO, MEASURE or QUANTIZE."""

    def __init__(self, dump_stats_path="./hqt_output/measure", fp8_config="E4M3", hp_dtype="bf16",
                 blocklist=None, allowlist=None, mode="AUTO", scale_method="maxabs_hw", observer="maxabs", **kwargs):
        if fp8_config != "E4M3" or observer != "maxabs" or scale_method != "maxabs_hw":
            raise ValueError("the double implements fp8_config E4M3, observer maxabs, scale_method maxabs_hw only")
        if mode not in ("AUTO", "MEASURE", "QUANTIZE"):
            raise ValueError(f"unknown mode {mode!r}")
        self.dump_stats_path, self.hp_dtype, self.mode = dump_stats_path, hp_dtype, mode
        self.blocklist = blocklist or {"names": [], "types": []}

    @property
    def measure(self):
        return self.mode == "MEASURE"

    @property
    def quantize(self):
        return self.mode == "QUANTIZE"


class _MeasuredModule(torch.nn.Module):
    """A patched module in measurement mode: the original's output, the largest |input| recorded."""

    def __init__(self, original):
        super().__init__()
        self.original = original
        self.input_maxabs = None

    def forward(self, input):
        _record("inc_calibration_inputs")
        maxabs = input.detach().abs().max().float().item()
        self.input_maxabs = maxabs if self.input_maxabs is None else max(self.input_maxabs, maxabs)
        return self.original(input)


def _hw_scale(maxabs, fp8_max):
    """The power of two that maps ``maxabs`` into the fp8 range (scales of 1 for an all-zero tensor)."""
    return 2.0 ** math.ceil(math.log2(maxabs / fp8_max)) if maxabs > 0 else 1.0


def _to_fp8(tensor, scale, fp8_max):
    return (tensor.float() / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)


class _Fp8Module(torch.nn.Module):
    """A patched module in quantization mode: fp8 weight and input with per-tensor scales."""

    def __init__(self, original, input_maxabs, fp8_max, hp_dtype):
        super().__init__()
        weight = original.weight.detach()
        self.fp8_max, self.hp_dtype = fp8_max, hp_dtype
        self.scale_input = _hw_scale(input_maxabs, fp8_max)
        self.scale_weight = _hw_scale(weight.abs().max().float().item(), fp8_max)
        self.weight = torch.nn.Parameter(_to_fp8(weight, self.scale_weight, fp8_max), requires_grad=False)
        self.bias = original.bias
        # DeepSpeed's row-parallel layer sums its ranks' partial products before adding the bias
        self.mp_group = getattr(original, "mp_group", None) if type(original).__name__ == "LinearAllreduce" else None

    def forward(self, input):
        product = torch.matmul(_to_fp8(input, self.scale_input, self.fp8_max).to(self.hp_dtype),
                               self.weight.to(self.hp_dtype).transpose(-1, -2))
        output = (product.float() * (self.scale_input * self.scale_weight)).to(self.hp_dtype)
        if self.mp_group is not None:
            torch.distributed.all_reduce(output, group=self.mp_group)
        if self.bias is not None:
            output = output + self.bias
        return output


def _patchable(model, blocked_names):
    return [(name, module) for name, module in model.named_modules()
            if type(module).__name__ in PATCHED_TYPES and not any(blocked in name for blocked in blocked_names)]


def _replace(model, name, module):
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def prepare(model, quant_config, inplace=True, example_inputs=None):
    """Patch the allowed modules to measure their inputs."""
    if not inplace:
        raise ValueError("the double prepares in place only")
    for name, module in _patchable(model, quant_config.blocklist.get("names", [])):
        _replace(model, name, _MeasuredModule(module))
    _record("inc_prepare")
    model.is_prepared, model.quant_config = True, quant_config
    return model


def _measured(model):
    return [(name, module) for name, module in model.named_modules() if isinstance(module, _MeasuredModule)]


def _measurement_file(dump_stats_path):
    if torch.distributed.is_initialized():
        rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        return f"{dump_stats_path}_hooks_maxabs_{rank}_{size}.json"
    return f"{dump_stats_path}_hooks_maxabs.json"


def finalize_calibration(model):
    """Write the measurements; a patched module that saw no input is an error, as a scale cannot be made."""
    unmeasured = [name for name, module in _measured(model) if module.input_maxabs is None]
    if unmeasured:
        raise RuntimeError(f"no measurement for {unmeasured[:3]}: run calibration inputs through the model first")
    path = _measurement_file(model.quant_config.dump_stats_path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as measurements:
        json.dump({name: {"inputs": [module.input_maxabs]} for name, module in _measured(model)}, measurements)
    _record("inc_finalize_calibration")


def convert(model, quant_config=None, inplace=True):
    """Swap every measured module for its fp8 form, with the measurements written by finalize_calibration."""
    config = quant_config or model.quant_config
    path = _measurement_file(config.dump_stats_path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"measurement file {path} not found: measure first")
    with open(path, encoding="utf-8") as measurements:
        input_maxabs = {name: stats["inputs"][0] for name, stats in json.load(measurements).items()}
    device_name = os.environ.get("HABANA_DOUBLE_DEVICE_NAME", "GAUDI2").upper()
    fp8_max = next(value for prefix, value in FP8_MAX.items() if device_name.startswith(prefix))
    hp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[config.hp_dtype]
    for name, module in _measured(model):
        _replace(model, name, _Fp8Module(module.original, input_maxabs[name], fp8_max, hp_dtype))
        _record("inc_fp8_layers")
    _record("inc_convert")
    model.is_quantized = True
    return model
