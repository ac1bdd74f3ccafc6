"""Where a run's model comes from, resolved once: a Hub id or a local folder (the built-in model when none
is given; a folder ``accelgen shard`` wrote is recognised), or, with random weights, a config to build the
model from (``accelgen.loading.random_weights``); and its loading, with no process ever holding the whole model
unless it runs the model alone."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Callable

import torch
import transformers
from transformers import GenerationConfig, PreTrainedTokenizerBase

from accelgen.common.errors import AccelgenWarning, UsageError
from accelgen.common.settings import RunSettings, World, torch_dtype
from accelgen.loading.checkpoint_conversions import converted
from accelgen.loading.checkpoint_download import checkpoint_folder
from accelgen.loading.checkpoint_files import CheckpointFolder
from accelgen.loading.kept_int8_weights import kept_int8_weights
from accelgen.loading.model_files import (
    BUILT_IN_NAME,
    DEFAULT_MODEL,
    load_config,
    load_tokenizer,
    loading_errors_as_usage_errors,
    model_location,
)
from accelgen.loading.model_identity import model_identity
from accelgen.loading.offload import Placement, check_offload_world, load_offloaded
from accelgen.loading.pre_sharded import check_sharded_for, missing_rank_file, rank_files, read_manifest
from accelgen.loading.random_weights import resolve_model_config, tokenizer_for
from accelgen.loading.weight_loading import HOST, load_weights
from accelgen.loading.weight_sources import PickleWeights, RandomWeights, SafetensorsWeights
from accelgen.model.architectures import architecture_of
from accelgen.model.empty_model import empty_model
from accelgen.model.memory import parameter_bytes
from accelgen.model.shape import check_shardable, slices_checkpoints
from accelgen.quantization.model_layers import empty_int8_layers, holds_int8_head, int8_layers
from accelgen.quantization.while_loading import QuantizingWeights


@dataclasses.dataclass
class OpenedModel:
    """A model ready to be given memory and filled: its empty ``skeleton``, where its weights come from,
    and its tokenizer. ``whole_tensors``: the source holds exactly this rank's tensors (pre-sharded)."""

    skeleton: torch.nn.Module
    weights: object
    tokenizer: PreTrainedTokenizerBase
    whole_tensors: bool = False


@dataclasses.dataclass
class LoadedCheckpoint:
    """A loaded model with its tokenizer, its parameter bytes before any split, and, when offloaded, where
    its weights sit."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    unsharded_parameter_bytes: int
    placement: Placement | None = None
    #: where int8 weights kept between loads came from or went (``accelgen.loading.kept_int8_weights``), as a phrase
    kept_weights: str | None = None


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """``name``: a Hub id or folder (None: the built-in model); with ``random_weights``, a built-in config
    name, a config.json, a model folder or a Hub id whose config alone is read.

    Everything it reads is read once and kept: where the model is (:attr:`location`), its config, a
    pre-sharded folder's manifest, and each weight file's header (checked before loading, loaded from)."""

    name: str | None = None
    random_weights: bool = False
    trust_remote_code: bool = False

    @functools.cached_property
    def location(self) -> str:
        """The checked local folder, or the Hub id, the model is read from (not used with random weights)."""
        return model_location(self.name)

    @functools.cached_property
    def local_folder(self) -> CheckpointFolder | None:
        """The model's local folder, whose weight files' headers are read once; None for a Hub id."""
        if self.random_weights or not os.path.isdir(self.location):
            return None
        return CheckpointFolder(self.location)

    @functools.cached_property
    def pre_sharded_manifest(self) -> dict | None:
        """The manifest when the model is a folder ``accelgen shard`` wrote, else None."""
        return None if self.local_folder is None else read_manifest(self.location)

    @functools.cached_property
    def _resolved(self) -> tuple[str, transformers.PretrainedConfig]:
        """(the name reports use, the model's config), read once; a local model's weight files checked."""
        if self.random_weights:
            return resolve_model_config(str(self.name or DEFAULT_MODEL), self.trust_remote_code)
        config = load_config(self.location, self.trust_remote_code)
        self._check_weight_files()
        return self.name or BUILT_IN_NAME, config

    def _check_weight_files(self) -> None:
        """Raise UsageError naming a damaged or missing weight file of a local model (headers only are read)."""
        if self.local_folder is None:
            return
        manifest = self.pre_sharded_manifest
        if manifest is not None:
            problem = missing_rank_file(self.location, manifest) or self.local_folder.problem(
                [name for files in manifest["rank_files"] for name in files])
        else:
            problem = self.local_folder.problem()
        if problem:
            fix = "shard the model again (accelgen shard)" if manifest else "download or save the model again"
            raise UsageError(f"Model {self.location!r} has a damaged weight file: {problem}: {fix}.")

    @property
    def report_name(self) -> str:
        """The model as reports name it: the Hub id of a built-in config, the given name, or the built-in model."""
        return self._resolved[0]

    @property
    def names(self) -> tuple[str, ...]:
        """What a row may call the model itself (an OpenAI batch request's ``model``): its name as given (the built-in
        model's without one), and its folder's last part."""
        name = self.name or BUILT_IN_NAME
        return (name, os.path.basename(os.path.normpath(name)))

    def identity(self) -> dict[str, str | None]:
        """The model by content (config and weights, or Hub revision): see ``accelgen.loading.model_identity``."""
        return model_identity(self.location, self.config())

    def config(self) -> transformers.PretrainedConfig:
        """The model's config (cheap: for checks made before any weights load)."""
        return self._resolved[1]

    def check_runs_on(self, world_size: int, dtype: str, quantize: str | None = None) -> None:
        """Raise UsageError when the model cannot run over ``world_size`` ranks in ``dtype`` (a family accelgen has not
        checked; a family or heads that do not split; a pre-sharded folder made for another world size or dtype):
        before any rank starts."""
        config = self.config()
        architecture = architecture_of(config)  # a family no test has shown right is refused here, before anything loads
        if self.trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
            raise UsageError(f"{self.location} runs code of its own (--trust-remote-code), which accelgen has not checked "
                             f"against Hugging Face: drop --trust-remote-code to run transformers' own "
                             f"{config.model_type} models.")
        quantized = getattr(config, "quantization_config", None)
        if quantized and not self.random_weights:
            method = quantized.get("quant_method", "a method") if isinstance(quantized, dict) else type(quantized).__name__
            raise UsageError(f"{self.location} holds weights quantized by {method}, which accelgen does not read: use "
                             f"the model's full-precision checkpoint (and --quantize int8 for int8 weights).")
        manifest = self.pre_sharded_manifest
        if manifest is not None:
            check_sharded_for(self.location, manifest, world_size, dtype, quantize)
        if world_size > 1:
            if architecture.not_split_because is not None:
                raise UsageError(f"{config.model_type} models do not run over --world-size {world_size}: "
                                 f"{architecture.not_split_because}; run "
                                 f"them in one process (--world-size 1, with --offload where they do not fit).")
            check_shardable(config, world_size)

    def load(
        self, run: RunSettings, device: torch.device, world: World,
        shard: Callable[[torch.nn.Module], torch.nn.Module] | None = None, free_bytes: int | None = None,
        device_is_host: bool = False, int8_head: bool = False, merges_adapter: bool = False,
    ) -> LoadedCheckpoint:
        """The model in ``run.dtype`` with its weights on ``device``. With ``shard`` (tensor parallelism,
        ``world.size`` > 1) this rank's part only: each rank reads its own slices of the checkpoint, or its
        own files of a pre-sharded one. With ``run.offload``, what does not fit the device's memory cap
        (``free_bytes``, the device's free memory, when no cap is given) stays in host memory or on disk;
        ``device_is_host``: the device computes in host memory; ``int8_head``: the device's int8 quantizes a head of
        its own too (``Accelerator.tuning.int8_quantizes_head``). In int8, one process's layers are quantized as they
        are read (each layer's full-precision weight held alone, then let go), unless ``merges_adapter``: a LoRA
        adapter is merged into the full-precision weights first, and the device quantizes them after; the int8 model
        is kept for the next load, and read from there when it was kept before
        (``accelgen.loading.kept_int8_weights``)."""
        self.check_runs_on(world.size, run.dtype, run.quantize)
        check_offload_world(run, world.size * world.replicas)  # the job's ranks: one copy each with one rank per replica
        opened = self.open(run.dtype, world)
        unsharded_parameter_bytes = parameter_bytes(opened.skeleton)  # before the skeleton is split in place
        placement, kept, kept_phrase = None, None, None
        pre_quantized = opened.whole_tensors and run.quantize is not None  # checked: the folder's scheme
        if run.offload is not None:
            model, placement = load_offloaded(opened.skeleton, opened.weights, device, run, free_bytes, device_is_host,
                                              pre_quantized, int8_head)
        elif world.size > 1 and not slices_checkpoints(self.config()):
            if world.is_main:
                warnings.warn(AccelgenWarning(
                    f"{self.config().model_type} models are not sliced while loading: each rank puts the whole model "
                    f"in host memory before DeepSpeed splits it"), stacklevel=2)
            model = shard(load_weights(opened.skeleton, opened.weights, World(), HOST))
        else:
            weights, before_filling, whole_tensors = opened.weights, None, opened.whole_tensors
            if pre_quantized:
                stored_head = holds_int8_head(opened.skeleton, opened.weights)
                before_filling = functools.partial(empty_int8_layers, head=stored_head)
            elif run.quantize == "int8" and world.size == 1 and not merges_adapter:
                before_filling = functools.partial(empty_int8_layers, head=int8_head)
                kept = None if self.random_weights else kept_int8_weights(
                    self.location, self.identity, opened.skeleton, run.dtype, int8_head)
                kept_weights = None if kept is None else kept.weights(opened.skeleton.base_model_prefix)
                if kept_weights is not None:
                    weights, whole_tensors, kept, kept_phrase = kept_weights, True, None, "int8 weights kept by an earlier load"
                else:
                    weights = QuantizingWeights(weights, set(int8_layers(opened.skeleton, int8_head)),
                                                torch_dtype(run.dtype))
            model = load_weights(opened.skeleton, weights, world, device, shard, whole_tensors,
                                 before_filling=before_filling)
            if kept is not None and kept.keep(model):
                kept_phrase = "int8 weights kept for the next load"
        return LoadedCheckpoint(model.eval(), opened.tokenizer, unsharded_parameter_bytes, placement, kept_phrase)

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer runs of this model use, read alone (no weights): to check prompts before loading."""
        if self.random_weights:
            return tokenizer_for(str(self.name or DEFAULT_MODEL), self.trust_remote_code)
        with loading_errors_as_usage_errors(self.location):
            return load_tokenizer(self.location, self.trust_remote_code)

    def open(self, dtype: str, world: World) -> OpenedModel:
        """The empty model, its weight source and its tokenizer (every rank must call this)."""
        config = self.config()
        if self.random_weights:
            skeleton = empty_model(config, dtype, self.trust_remote_code)
            shapes = {name: tuple(parameter.shape) for name, parameter in skeleton.named_parameters()}
            weights = RandomWeights(shapes, std=getattr(config, "initializer_range", 0.02))
            return OpenedModel(skeleton, weights, tokenizer_for(str(self.name or DEFAULT_MODEL), self.trust_remote_code))
        folder = checkpoint_folder(self.location, world)
        checkpoint = self.local_folder or CheckpointFolder(folder)  # a Hub model's downloaded folder
        with loading_errors_as_usage_errors(folder):
            tokenizer = load_tokenizer(folder, self.trust_remote_code)
            skeleton = empty_model(config, dtype, self.trust_remote_code)
            if os.path.isfile(os.path.join(folder, "generation_config.json")):
                skeleton.generation_config = GenerationConfig.from_pretrained(folder)
            prefix = skeleton.base_model_prefix
            manifest = self.pre_sharded_manifest
            if manifest is not None:
                weights = SafetensorsWeights(rank_files(folder, manifest, world.rank), prefix, where=folder,
                                             read_header=checkpoint.header)
                return OpenedModel(skeleton, weights, tokenizer, whole_tensors=True)
            files, are_safetensors = checkpoint.weight_files()
            if not are_safetensors:
                warnings.warn(AccelgenWarning(
                    f"{folder} has pickle (.bin) weights, read file by file; safetensors load faster and slice by "
                    f"slice (save the model with save_pretrained, or use accelgen shard)"), stacklevel=2)
                weights = PickleWeights(files, prefix)
            else:
                weights = SafetensorsWeights(files, prefix, read_header=checkpoint.header)
            weights = converted(weights, skeleton)
        return OpenedModel(skeleton, weights, tokenizer)


def refuse_unsliced_family(config: transformers.PretrainedConfig) -> None:
    """Raise UsageError for a family accelgen cannot pre-shard (its split is not checked for slicing)."""
    if not slices_checkpoints(config):
        raise UsageError(f"accelgen shard does not know how DeepSpeed splits {config.model_type} models yet: "
                         f"run them unsharded (accelgen run --world-size N --model the original folder).")
