"""A model's skeleton without its weights: every parameter on the meta device (a shape and a dtype, no
memory), so that a model of any size is built in a moment, then split and filled part by part
(``accelgen.loading.weight_loading``). Buffers are computed as usual (rotary frequencies: small, and not in
checkpoints), so they hold their real values."""

from __future__ import annotations

import contextlib

import torch
import transformers
from transformers import AutoModelForCausalLM

from accelgen.common.settings import torch_dtype
from accelgen.model.transformers_adapter import DTYPE_KEYWORD


def empty_model(config: transformers.PretrainedConfig, dtype: str, trust_remote_code: bool = False) -> torch.nn.Module:
    """The model ``config`` describes, in eval mode and ``dtype``, its parameters on the meta device."""
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=trust_remote_code, **{DTYPE_KEYWORD: torch_dtype(dtype)}
        )
    return model.eval()


def import_model_code(config: transformers.PretrainedConfig) -> None:
    """Import the transformers module that defines ``config``'s model now (transformers imports it lazily when the
    model is built: seconds of imports, torch's compiler included, on the way of every run), so that a command can
    do it at its start, where Ctrl-C ends it at once. Models of remote code are left to their loading."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    with contextlib.suppress(KeyError):
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def is_empty(model: torch.nn.Module) -> bool:
    """True when the model's parameters have no memory yet."""
    return any(parameter.is_meta for parameter in model.parameters())


@contextlib.contextmanager
def parameters_on_meta():
    """Within the block, each parameter a module registers goes to the meta device (buffers stay real)."""
    register_parameter = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, parameter: torch.nn.Parameter | None) -> None:
        register_parameter(module, name, parameter)
        if parameter is not None and not parameter.is_meta:
            module._parameters[name] = torch.nn.Parameter(parameter.to("meta"), requires_grad=parameter.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register_parameter
