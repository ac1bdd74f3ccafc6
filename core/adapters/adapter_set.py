"""The LoRA adapters of a run (``--lora``), read and checked against the model before it loads: each adapted module
must be a linear layer of the model (not its output head), of the shapes the adapter's matrices were trained for, at a
rank the buffers hold, its values within what the run's dtype holds. A mismatch is one line naming the adapter, the
module and the fix."""

from __future__ import annotations

import torch
import transformers

from accelgen.adapters.adapter_files import AdaptedLayer, AdapterFiles
from accelgen.common.errors import UsageError
from accelgen.common.settings import AdapterSettings, World, torch_dtype
from accelgen.model.empty_model import empty_model


class AdapterSet:
    """The adapters ``settings`` name (each read when this is made): ``named`` ones rows choose, by name, and the one
    ``merged`` into the weights (or None)."""

    def __init__(self, settings: AdapterSettings, world: World = World()):
        self.settings = settings
        self.named = {name: AdapterFiles(name, source, world) for name, source in settings.named}
        self.merged = None if settings.merged is None else AdapterFiles(None, settings.merged, world)

    def __bool__(self) -> bool:
        return bool(self.named) or self.merged is not None

    @property
    def rank(self) -> int:
        """The rank of the buffers: ``--max-lora-rank``, or the largest among the named adapters."""
        return self.settings.max_lora_rank or max((adapter.rank for adapter in self.named.values()), default=1)

    def targets(self) -> dict[str, tuple[int, int]]:
        """The modules any named adapter adapts, with their (in, out) features (whole, before any split)."""
        return {module: (layer.in_features, layer.out_features)
                for adapter in self.named.values() for module, layer in adapter.layers.items()}

    def record(self) -> dict:
        """The adapters by content, for a run record: a resumed run must serve the same ones."""
        record = {name: adapter.identity for name, adapter in self.named.items()}
        if self.merged is not None:
            record["merged"] = self.merged.identity
        return {"lora": record} if record else {}

    def check_fits(self, config: transformers.PretrainedConfig, dtype: str, trust_remote_code: bool = False) -> None:
        """Raise UsageError when an adapter does not fit the model of ``config`` (its skeleton is built, without
        weights) or the buffers' rank."""
        if not self:
            return
        skeleton = empty_model(config, dtype, trust_remote_code)
        for adapter in [*self.named.values(), *([self.merged] if self.merged else [])]:
            for module, layer in adapter.layers.items():
                _check_layer(adapter, skeleton, module, layer)
            _check_range(adapter, dtype)
            if adapter is not self.merged and adapter.rank > self.rank:
                raise adapter.refuse(f"has rank {adapter.rank}, above --max-lora-rank {self.rank}",
                                     f"raise --max-lora-rank to {adapter.rank}")


def linear_features(module: torch.nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear layer of a Hugging Face model (``nn.Linear`` and its subclasses, GPT-2's
    ``Conv1D``, whose weight is stored [in, out]); None for any other module."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, transformers.pytorch_utils.Conv1D):
        return tuple(module.weight.shape)
    return None


def _check_layer(adapter: AdapterFiles, skeleton: torch.nn.Module, module: str, layer: AdaptedLayer) -> None:
    """Raise UsageError unless ``module`` of the model is a linear layer ``layer`` fits."""
    trained_on = adapter.config.get("base_model_name_or_path")
    another = f"it was trained on another model{f' ({trained_on})' if trained_on else ''}"
    try:
        target = skeleton.get_submodule(module)
    except AttributeError:
        raise adapter.refuse(f"adapts {module!r}, which this model does not have: {another}",
                             "pass the adapters of this model") from None
    if target is skeleton.get_output_embeddings():
        raise adapter.refuse(f"adapts the output head {module!r}", "accelgen adapts the linear layers of the decoder only")
    features = linear_features(target)
    if features is None:
        raise adapter.refuse(f"adapts {module!r}, a {type(target).__name__}",
                             "accelgen adapts linear layers only (not embeddings, norms or convolutions)")
    if features != (layer.in_features, layer.out_features):
        raise adapter.refuse(f"adapts {module!r} as {layer.in_features} -> {layer.out_features} features, and this model's "
                             f"is {features[0]} -> {features[1]}: {another}", "pass the adapters of this model")


def _check_range(adapter: AdapterFiles, dtype: str) -> None:
    """Raise UsageError when a value of ``adapter`` (B's times its scaling) is beyond what ``dtype`` holds: it would be
    inf in the buffers (or the merged weights): in A, the adapter's own rows are wrong; in B, every row of the batch is
    (the other rows' zeros times inf are NaN)."""
    most = torch.finfo(torch_dtype(dtype)).max
    for tensor, largest in adapter.largest.items():
        if largest > most:
            scaled = " after its scaling" if tensor.endswith(".lora_B.weight") else ""
            fix = "run in --dtype float32 or bfloat16, or train the adapter again" if dtype == "float16" else \
                "train the adapter again"
            raise adapter.refuse(f"holds values beyond {dtype}'s range in {tensor!r} (largest {largest:.3g}{scaled})", fix)


def check_names(settings: AdapterSettings, model_names: tuple[str, ...]) -> None:
    """Raise UsageError for adapter names rows could not tell apart: repeated, or the model's own (a batch request's
    ``model`` names the one or the other)."""
    seen = set()
    for name in settings.names:
        if name in seen:
            raise UsageError(f"--lora {name}=... is given twice: give each adapter a name of its own.")
        if name in model_names:
            raise UsageError(f"--lora {name}=... is named as the model is: a request naming {name!r} would not say "
                             f"which it means; rename the adapter.")
        seen.add(name)
