"""Where a run's model comes from, resolved once: a Hub id or a local folder (the built-in model when none
is given), or, with random weights, a config to build the model from (``accelgen.random_weights``)."""

from __future__ import annotations

import dataclasses
import functools

import torch
import transformers
from transformers import PreTrainedTokenizerBase

from accelgen.model_identity import model_identity
from accelgen.models import BUILT_IN_NAME, DEFAULT_MODEL, check_weight_files, load_config, load_model, model_source
from accelgen.random_weights import build_random_model, resolve_model_config, tokenizer_for


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """``name``: a Hub id or folder (None: the built-in model); with ``random_weights``, a built-in config
    name, a config.json, a model folder or a Hub id whose config alone is read."""

    name: str | None = None
    random_weights: bool = False
    trust_remote_code: bool = False

    @functools.cached_property
    def _resolved(self) -> tuple[str, transformers.PretrainedConfig]:
        """(the name reports use, the model's config), read once."""
        if self.random_weights:
            return resolve_model_config(str(self.name or DEFAULT_MODEL), self.trust_remote_code)
        config = load_config(self.name, self.trust_remote_code)
        check_weight_files(self.name)
        return self.name or BUILT_IN_NAME, config

    @property
    def report_name(self) -> str:
        """The model as reports name it: the Hub id of a built-in config, the given name, or the built-in model."""
        return self._resolved[0]

    def identity(self) -> dict[str, str | None]:
        """The model by content (config and weights, or Hub revision): see ``accelgen.model_identity``."""
        return model_identity(model_source(self.name), self.config())

    def config(self) -> transformers.PretrainedConfig:
        """The model's config (cheap: for checks made before any weights load)."""
        return self._resolved[1]

    def load(self, dtype: str, device: torch.device) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
        """The model in ``dtype`` and its tokenizer: random weights drawn directly on ``device``, real ones
        read into host memory (the accelerator moves or shards them)."""
        if self.random_weights:
            model = build_random_model(self.config(), dtype, device, self.trust_remote_code)
            return model, tokenizer_for(str(self.name or DEFAULT_MODEL), self.trust_remote_code)
        return load_model(self.name, dtype, self.trust_remote_code, config=self.config())
