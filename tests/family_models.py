"""Tiny random checkpoints of every family in ``accelgen.model.architectures``, built from their configs.

Each is small (2 layers, hidden size 64) but keeps what sets its family apart: grouped key/value heads, biases,
query/key norms, soft-capping, sliding-window layers whose window (8 tokens) is shorter than the prompts, so that
the window decides what a query sees, layers of mixed kinds, experts of which each token takes two.
"""

from __future__ import annotations

from pathlib import Path

import transformers
from tiny_models import BOS_ID, EOS_ID, PAD_ID, build_model
from transformers import AutoConfig

#: A sliding layer's window in these models: shorter than most test prompts and their completions.
WINDOW = 8

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
               tie_word_embeddings=False)
_EXPERTS = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)

#: What each family's tiny config sets beyond the common sizes.
FAMILY_SETTINGS = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # layer 0 full, layer 1 sliding
    "qwen3": dict(head_dim=16),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
    "smollm3": dict(no_rope_layer_interval=2),  # every second layer without rotary positions
    "gemma2": dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16),
    "gemma3_text": dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16, sliding_window_pattern=2,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": {},
    "olmo2": {},
    "gpt_neox": dict(rotary_pct=0.5, use_parallel_residual=True),
    "mixtral": dict(_EXPERTS),
    "qwen3_moe": dict(_EXPERTS, head_dim=16, decoder_sparse_step=1, mlp_only_layers=[]),
    "gpt_oss": dict(_EXPERTS, head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
}

#: The families whose tokens each take some of their experts.
EXPERT_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")

#: The families whose parity the tests check beyond the five of tiny_models (BLOOM, GPT-2, Llama, OPT, Falcon).
FAMILIES = tuple(family for family in FAMILY_SETTINGS if family != "llama")


def installed(family: str) -> bool:
    """Whether the installed transformers release has the family."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return family in CONFIG_MAPPING_NAMES


def skip_unless_installed(family: str) -> None:
    """Skip the calling test, saying why, where the installed transformers release has no ``family`` models."""
    import pytest

    if not installed(family):
        pytest.skip(f"transformers {transformers.__version__} has no {family} models")


def family_config(family: str, vocab_size: int, **changes) -> transformers.PretrainedConfig:
    """The family's tiny config (with ``changes`` to its settings)."""
    settings = dict(_COMMON, vocab_size=vocab_size, **{**FAMILY_SETTINGS[family], **changes})
    return AutoConfig.for_model(family, **settings)


def build_family_model(folder: Path, family: str, vocab_size: int, seed: int = 0, **changes) -> Path:
    """A random-weight checkpoint of ``family`` (with ``changes`` to its settings) saved in ``folder`` (safetensors),
    as its own release saves it."""
    return build_model(folder, family_config(family, vocab_size, **changes), seed)
