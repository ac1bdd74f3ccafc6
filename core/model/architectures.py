"""What differs between model families, in one table, so that nothing else asks ``model_type == ...``.

For each family the static pipeline is checked on (greedy parity with Hugging Face, and a decode step
that never waits for the host, on every transformers release CI runs): whether a model takes the core's 4D
attention mask as it is (``accelgen.model.transformers_adapter.forward``), and what to change in it, once, for its decode
step to hold nothing a captured graph cannot (BLOOM: ALiBi slopes kept on the device, and only this
rank's; Falcon: its multi-query head split without index lists). Families not in the table get Hugging
Face's own masks and no change: they run, and capture where their code allows.

Under tensor parallelism the table also says how a family's key/value heads are counted (they must split
evenly over the ranks) and which of its linear layers are row parallel: for those families each rank reads
only its own slices of the checkpoint (``accelgen.loading.weight_loading``); the others load whole on every rank
before DeepSpeed splits them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import transformers

from accelgen.common.settings import World
from accelgen.model.transformers_adapter.alibi import use_rank_alibi
from accelgen.model.transformers_adapter.falcon import split_multi_query_heads_by_slicing


@dataclasses.dataclass(frozen=True)
class Architecture:
    #: The model takes a 4D additive mask [B, 1, T, L] as it is, on every supported transformers release.
    takes_4d_mask: bool = False
    #: ``make_capturable(model, world)``: changes the model in place (idempotent), or None.
    make_capturable: Callable[[torch.nn.Module, World], None] | None = None
    #: ``count_key_value_heads(config)`` where the config's ``num_key_value_heads`` (or its absence) misleads.
    count_key_value_heads: Callable[[transformers.PretrainedConfig], int] | None = None
    #: Class name of the family's decoder layer, and the linear layers in it whose input dimension is split
    #: over the ranks (row parallel: each rank's partial outputs are summed by an all-reduce). Every other
    #: linear layer in it is column parallel (split by its output rows; a fused query/key/value projection
    #: only where its rows are grouped by head, as BLOOM's are). Given to DeepSpeed as its injection policy,
    #: so the split DeepSpeed makes is the one the checkpoint is sliced by; named as DeepSpeed names them
    #: (relative to the decoder layer, a direct child with a leading dot). None: not checked for slicing.
    decoder_layer: str | None = None
    row_parallel: tuple[str, ...] = ()
    #: A token's values depend on its position id and on the keys its mask lets it see, nothing else (rotary
    #: embeddings; no position read off the mask): prompts may run one after another in one row, kept apart by the
    #: mask, where a batch pads each to the longest (``ModelForward.packed_logits``).
    packs_prompts: bool = False


def _falcon_key_value_heads(config: transformers.PretrainedConfig) -> int:
    """Falcon states its key/value heads in three ways, by generation."""
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


#: The families checked, by ``config.model_type``. Not listed on purpose: models with sliding-window or
#: chunked attention (Mistral, Gemma 2/3, ...), whose layers need masks that one 4D mask cannot give.
ARCHITECTURES = {
    "bloom": Architecture(takes_4d_mask=True, make_capturable=use_rank_alibi, decoder_layer="BloomBlock",
                          row_parallel=("self_attention.dense", "mlp.dense_4h_to_h")),
    "falcon": Architecture(takes_4d_mask=True, make_capturable=split_multi_query_heads_by_slicing,
                           count_key_value_heads=_falcon_key_value_heads),
    "gpt2": Architecture(takes_4d_mask=True),
    "llama": Architecture(takes_4d_mask=True, decoder_layer="LlamaDecoderLayer",
                          row_parallel=("self_attn.o_proj", "mlp.down_proj"), packs_prompts=True),
    "opt": Architecture(takes_4d_mask=True, decoder_layer="OPTDecoderLayer", row_parallel=("self_attn.out_proj", ".fc2")),
}


def architecture_of(config: transformers.PretrainedConfig) -> Architecture:
    """The table's entry for ``config``; unknown families get Hugging Face's masks and no change."""
    architecture = ARCHITECTURES.get(config.model_type, Architecture())
    if getattr(config, "alibi", False) and config.model_type == "falcon":
        # Falcon's ALiBi variant builds its bias from the 2D mask inside the model: leave it that mask.
        architecture = dataclasses.replace(architecture, takes_4d_mask=False)
    return architecture
