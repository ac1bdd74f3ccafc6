"""Models built from a config alone, with seeded random weights, for benchmarking without downloads.

Decode speed does not depend on weight values, so a model of the right shape measures what the real
one would; its values come from ``accelgen.loading.weight_sources.RandomWeights``, drawn where they are held. ``--model-config`` names the shape: a built-in config of a published model (the BLOOM
family the published Gaudi / A100 tables measure), a local ``config.json`` (or a folder holding one),
or a Hub id whose config is fetched (a few kilobytes, no weights).
"""

from __future__ import annotations

import os

import transformers
from transformers import AutoConfig, BloomConfig, PreTrainedTokenizerBase

from accelgen.common.errors import UsageError
from accelgen.loading.hub_reach import check_hub_reachable
from accelgen.loading.model_files import DEFAULT_MODEL, load_tokenizer, loading_errors_as_usage_errors, looks_local

#: Shapes of the published BLOOM models (their config.json on the Hub), by their Hub ids.
BUILT_IN_CONFIGS = {
    "bigscience/bloom": dict(n_layer=70, hidden_size=14336, n_head=112),  # 176B
    "bigscience/bloomz": dict(n_layer=70, hidden_size=14336, n_head=112),  # 176B, BLOOM fine-tuned
    "bigscience/bloomz-7b1": dict(n_layer=30, hidden_size=4096, n_head=32),  # 7.1B
    "bigscience/bloom-560m": dict(n_layer=24, hidden_size=1024, n_head=16),  # 0.56B, for small machines
}
BLOOM_VOCABULARY = 250880


def built_in_config_name(name: str) -> str | None:
    """The Hub id of a built-in config named ``name`` (``bloomz-7b1`` or ``bigscience/bloomz-7b1``)."""
    for hub_id in BUILT_IN_CONFIGS:
        if name in (hub_id, hub_id.split("/")[1]):
            return hub_id
    return None


def resolve_model_config(name: str, trust_remote_code: bool = False) -> tuple[str, transformers.PretrainedConfig]:
    """(model name for reports, config) for ``--model-config``: built-in name, local file or folder, or Hub id."""
    hub_id = built_in_config_name(name)
    if hub_id is not None:
        return hub_id, BloomConfig(vocab_size=BLOOM_VOCABULARY, **BUILT_IN_CONFIGS[hub_id])
    if looks_local(name):
        path = os.path.expanduser(name)
        if not os.path.exists(path):
            raise UsageError(f"--model-config {name!r} does not exist: pass a config.json, a model folder, "
                             f"a Hub id, or one of: {', '.join(BUILT_IN_CONFIGS)}.")
        config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        with loading_errors_as_usage_errors(name):
            config_dictionary, _ = transformers.PretrainedConfig.get_config_dict(config_file)
            if "model_type" not in config_dictionary:
                raise ValueError(f"{config_file} has no model_type")
            config = AutoConfig.for_model(**config_dictionary)
        return config_dictionary.get("_name_or_path") or os.path.basename(os.path.abspath(path)), config
    check_hub_reachable(name, "model config")  # at once, not after the Hub client's retries
    with loading_errors_as_usage_errors(name):
        return name, AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)


def tokenizer_for(name: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer for a random-weight model: the model's own when ``name`` is a folder or Hub id that
    has one, else the built-in default model's (only the prompt's length in tokens matters for timing,
    and where the tokenizer came from is recorded with the results: ``accelgen.loading.model_files.tokenizer_source``)."""
    if built_in_config_name(name) is None and not name.endswith(".json"):
        try:
            return load_tokenizer(os.path.expanduser(name), trust_remote_code)
        except (OSError, ValueError):
            pass
    return load_tokenizer(str(DEFAULT_MODEL))
