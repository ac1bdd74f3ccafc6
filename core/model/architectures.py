"""What differs between model families, in one table, so that nothing else asks ``model_type == ...``.

A family runs only once it is an entry here: each entry is checked by the family matrix of the tests (greedy and
sampled tokens equal to Hugging Face ``generate``, one prompt at a time and in mixed batches, on every transformers
release CI runs). A model of any other family is refused before it loads (:func:`architecture_of`), since the
pipeline around a family no test has run can give other tokens than Hugging Face's without a sign.

Every family takes the core's 4D additive mask (``accelgen.model.transformers_adapter.forward``), one per kind of
attention layer it has (:func:`layer_windows`: full, or a sliding window of N tokens); a family whose layers are of
several kinds takes them as a mapping by layer type (``masks_by_layer_type``). The table also says what to change in
a model, once, for its decode step to hold nothing a captured graph cannot (BLOOM: ALiBi slopes kept on the device,
and only this rank's; Falcon: its multi-query head split without index lists).

Under tensor parallelism the table says how a family's key/value heads are counted (they must split evenly over the
ranks) and which of its linear layers are row parallel: for those families each rank reads only its own slices of
the checkpoint (``accelgen.loading.weight_loading``); the others load whole on every rank before DeepSpeed splits
them. A family whose layers cannot be split (a norm over a whole projection, experts) is refused under
``--world-size`` N > 1 with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import transformers

from accelgen.common.errors import UsageError
from accelgen.common.settings import World
from accelgen.model.transformers_adapter.alibi import use_rank_alibi
from accelgen.model.transformers_adapter.falcon import split_multi_query_heads_by_slicing

#: Layer types (transformers' ``config.layer_types`` names) whose mask the core builds: all positions up to the
#: query's own, or the last ``sliding_window`` of them.
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclasses.dataclass(frozen=True)
class Architecture:
    #: The model takes a 4D additive mask [B, 1, T, L] as it is, on every supported transformers release.
    takes_4d_mask: bool = True
    #: The model's forward takes a mapping {layer type: 4D mask} where its layers are of several kinds.
    masks_by_layer_type: bool = False
    #: ``make_capturable(model, world)``: changes the model in place (idempotent), or None.
    make_capturable: Callable[[torch.nn.Module, World], None] | None = None
    #: ``count_key_value_heads(config)`` where the config's ``num_key_value_heads`` (or its absence) misleads.
    count_key_value_heads: Callable[[transformers.PretrainedConfig], int] | None = None
    #: Class name of the family's decoder layer, and the linear layers in it whose input dimension is split
    #: over the ranks (row parallel: each rank's partial outputs are summed by an all-reduce). Every other
    #: linear layer in it is column parallel (split by its output rows; a fused query/key/value projection
    #: only where its rows are grouped by head, as BLOOM's and GPT-NeoX's are). Given to DeepSpeed as its injection
    #: policy, so the split DeepSpeed makes is the one the checkpoint is sliced by; named as DeepSpeed names them
    #: (relative to the decoder layer, a direct child with a leading dot). None: not checked for slicing.
    decoder_layer: str | None = None
    row_parallel: tuple[str, ...] = ()
    #: Why the family cannot be split over ranks (None: it can).
    not_split_because: str | None = None
    #: A token's values depend on its position id and on the keys its mask lets it see, nothing else (rotary
    #: embeddings; no position read off the mask): prompts may run one after another in one row, kept apart by the
    #: mask, where a batch pads each to the longest (``ModelForward.packed_logits``).
    packs_prompts: bool = False
    #: Its attention module computes, between its ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` products, exactly
    #: Llama's: rotary embedding by transformers' ``apply_rotary_pos_emb`` on every layer, the cache write and the
    #: attention scaled by the module's ``scaling``; no norm, soft-capping or sink. A device may then fuse a decode
    #: step's attention between the products (the CPU plugin's ``decode_self_attention``).
    llama_attention: bool = False
    #: ``finish_logits(config, logits)``: what the family's causal-LM head does to the output projection's logits
    #: (Gemma's soft-capping, Granite's scaling), for logits computed from its hidden states (prompt scores); None:
    #: the projection's logits are the model's.
    finish_logits: Callable[[transformers.PretrainedConfig, torch.Tensor], torch.Tensor] | None = None


def _soft_capped(config: transformers.PretrainedConfig, logits: torch.Tensor) -> torch.Tensor:
    """Gemma 2's and 3's final soft-capping, as their causal-LM head applies it."""
    cap = config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _scaled(config: transformers.PretrainedConfig, logits: torch.Tensor) -> torch.Tensor:
    """Granite's logits, divided by its ``logits_scaling``."""
    return logits / config.logits_scaling


def _falcon_key_value_heads(config: transformers.PretrainedConfig) -> int:
    """Falcon states its key/value heads in three ways, by generation."""
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


_LLAMA_ROWS = ("self_attn.o_proj", "mlp.down_proj")
_EXPERTS = "its experts are not split over ranks yet"


def _llama_like(decoder_layer: str, **features) -> Architecture:
    """A family laid out as Llama is: rotary positions, q/k/v/o and gate/up/down projections."""
    return Architecture(decoder_layer=decoder_layer, row_parallel=_LLAMA_ROWS, packs_prompts=True, **features)


#: The families checked, by ``config.model_type``.
ARCHITECTURES = {
    "bloom": Architecture(make_capturable=use_rank_alibi, decoder_layer="BloomBlock",
                          row_parallel=("self_attention.dense", "mlp.dense_4h_to_h")),
    "falcon": Architecture(make_capturable=split_multi_query_heads_by_slicing,
                           count_key_value_heads=_falcon_key_value_heads),
    "gpt2": Architecture(),
    "opt": Architecture(decoder_layer="OPTDecoderLayer", row_parallel=("self_attn.out_proj", ".fc2")),
    "llama": _llama_like("LlamaDecoderLayer", llama_attention=True),
    "mistral": _llama_like("MistralDecoderLayer", llama_attention=True),
    "qwen2": _llama_like("Qwen2DecoderLayer", llama_attention=True, masks_by_layer_type=True),
    "qwen3": _llama_like("Qwen3DecoderLayer", masks_by_layer_type=True),
    "granite": _llama_like("GraniteDecoderLayer", llama_attention=True, finish_logits=_scaled),
    "smollm3": _llama_like("SmolLM3DecoderLayer", masks_by_layer_type=True),
    "gemma2": _llama_like("Gemma2DecoderLayer", masks_by_layer_type=True, finish_logits=_soft_capped),
    "gemma3_text": _llama_like("Gemma3DecoderLayer", masks_by_layer_type=True, finish_logits=_soft_capped),
    # Phi-3's query/key/value and gate/up projections are fused, their rows not grouped by head
    "phi3": Architecture(packs_prompts=True, not_split_because="DeepSpeed's split of its fused projections fails"),
    # OLMo 2 normalizes queries and keys over all heads at once: a rank holds only its heads
    "olmo2": Architecture(packs_prompts=True, not_split_because="its query and key norms span every head"),
    "gpt_neox": Architecture(decoder_layer="GPTNeoXLayer", row_parallel=("attention.dense", "mlp.dense_4h_to_h"),
                             packs_prompts=True),
    "mixtral": Architecture(packs_prompts=True, not_split_because=_EXPERTS),
    "qwen3_moe": Architecture(packs_prompts=True, masks_by_layer_type=True, not_split_because=_EXPERTS),
    "gpt_oss": Architecture(packs_prompts=True, masks_by_layer_type=True, not_split_because=_EXPERTS),
}


def architecture_of(config: transformers.PretrainedConfig) -> Architecture:
    """The table's entry for ``config``; raises UsageError, in one line, for a family outside the table or a model
    with layers it has no mask for."""
    architecture = ARCHITECTURES.get(config.model_type)
    if architecture is None:
        raise UsageError(
            f"{config.model_type} models are not among the model families accelgen has checked against Hugging "
            f"Face (its output could differ, unseen), so they are refused: use one of {', '.join(sorted(ARCHITECTURES))}"
            f" (docs/models.md says how a family is added).")
    windows = layer_windows(config)
    if len(windows) > 1 and not architecture.masks_by_layer_type:
        raise UsageError(f"this {config.model_type} model mixes layers of kinds {', '.join(windows)}, which accelgen "
                         f"runs for this family with one mask: use a config whose layers are of one kind.")
    if getattr(config, "alibi", False) and config.model_type == "falcon":
        # Falcon's ALiBi variant builds its bias from the 2D mask inside the model: leave it that mask.
        architecture = dataclasses.replace(architecture, takes_4d_mask=False)
    return architecture


def layer_windows(config: transformers.PretrainedConfig) -> dict[str, int | None]:
    """The kinds of attention layer the model has, each with the number of latest positions its queries see (None:
    all up to their own), in the order they first appear: read as transformers reads them (``config.layer_types``,
    else every layer sliding where the config has a ``sliding_window``). Raises UsageError for a kind the core
    builds no mask for (chunked attention, state-space or linear layers)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        layer_types = [SLIDING if window is not None else FULL]
        if getattr(config, "attention_chunk_size", None) is not None:
            layer_types = ["chunked_attention"]
    windows = {}
    for layer_type in layer_types:
        if layer_type not in (FULL, SLIDING):
            raise UsageError(f"this {config.model_type} model has {layer_type} layers, whose masks accelgen does not "
                             f"build: use a model whose layers are full or sliding-window attention.")
        windows[layer_type] = window if layer_type == SLIDING else None
    return windows

