"""Vocabulary-parallel input embedding and output head for tensor-parallel inference.

DeepSpeed's AutoTP leaves the input embedding whole on every rank and gives the output head a
separate (untied) copy split along the hidden size, so a rank of a tied-embedding model such as
BLOOM holds the vocabulary matrix twice over, which for a model with a large vocabulary is most of what
splitting was meant to save. Here each rank keeps one slice of the vocabulary rows, shared by the embedding
and (for tied models) the head, and the collectives put the full results back together:

- embedding: each rank embeds the ids in its slice (zeros elsewhere); an all-reduce sums them.
- head: each rank computes the logits of its slice; an all-gather concatenates them.

Both results equal the unsharded ones exactly: each value is computed on one rank, others add zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from accelgen.common.settings import World


def vocabulary_slice(vocab_size: int, world: World) -> tuple[int, int, int]:
    """(first row, rows held, rows allotted) of this rank; the last rank's allotment is zero-padded."""
    allotted = -(-vocab_size // world.size)
    first = world.rank * allotted
    held = max(0, min(vocab_size, first + allotted) - first)
    return first, held, allotted


def rank_rows(full_weight: torch.Tensor, world: World) -> nn.Parameter:
    """This rank's rows of a vocabulary matrix [V, H] -> [V / N (padded), H]; without memory (meta) when
    ``full_weight`` has none, to be filled from the checkpoint (rows past the vocabulary stay zero)."""
    first, held, allotted = vocabulary_slice(full_weight.shape[0], world)
    shard = full_weight.new_zeros((allotted, full_weight.shape[1]))
    if not shard.is_meta:
        shard[:held] = full_weight[first : first + held]
    return nn.Parameter(shard, requires_grad=False)


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` whose rows are split over the ranks, its vectors multiplied by ``embed_scale`` where the
    embedding it replaces scales them (Gemma's). input_ids [*] -> embeddings [*, H]."""

    def __init__(self, weight_shard: nn.Parameter, vocab_size: int, world: World,
                 embed_scale: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight_shard  # [V / N (padded), H]
        self.first_row = vocabulary_slice(vocab_size, world)[0]
        self.vocab_size = vocab_size
        self.register_buffer("embed_scale", embed_scale, persistent=False)  # a scalar, or None (goes to the device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.first_row
        elsewhere = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        embedded = F.embedding(local_ids.masked_fill(elsewhere, 0), self.weight)
        embedded = embedded.masked_fill(elsewhere.unsqueeze(-1), 0)
        torch.distributed.all_reduce(embedded)  # each vector from one rank: exact
        if self.embed_scale is not None:  # as the scaled embedding does: after the lookup, in the weight's dtype
            embedded = embedded * self.embed_scale.to(self.weight.dtype)
        return embedded


class VocabParallelHead(nn.Module):
    """The output projection with its vocabulary rows split over the ranks. hidden [*, H] -> logits [*, V]."""

    def __init__(self, weight_shard: nn.Parameter, vocab_size: int, world: World):
        super().__init__()
        self.weight = weight_shard  # [V / N (padded), H], shared with the embedding when tied
        self.vocab_size = vocab_size
        self.world_size = world.size

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        local_logits = F.linear(hidden_states, self.weight).contiguous()
        gathered = [torch.empty_like(local_logits) for _ in range(self.world_size)]
        torch.distributed.all_gather(gathered, local_logits)
        return torch.cat(gathered, dim=-1)[..., : self.vocab_size]


def split_vocabulary(model: nn.Module, world: World) -> bool:
    """Replace ``model``'s embedding and output head by vocabulary-parallel ones holding this rank's rows
    (one matrix for both when they are tied); False, and nothing changed, for models whose embedding or
    head is not a plain matrix (a head with a bias; an embedding of a class of its own that does more than look up,
    or than scale what it looks up by its scalar ``embed_scale``, as Gemma's do)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    embed_scale = getattr(embedding, "embed_scale", None)
    scaled = isinstance(embed_scale, torch.Tensor) and embed_scale.dim() == 0
    if not ((type(embedding) is nn.Embedding or (isinstance(embedding, nn.Embedding) and scaled))
            and type(head) is nn.Linear and head.bias is None):
        return False
    vocab_size = embedding.weight.shape[0]
    embedding_shard = rank_rows(embedding.weight.detach(), world)
    tied = head.weight is embedding.weight
    head_shard = embedding_shard if tied else rank_rows(head.weight.detach(), world)
    model.set_input_embeddings(VocabParallelEmbedding(embedding_shard, vocab_size, world,
                                                      embed_scale.detach().clone() if scaled else None))
    model.set_output_embeddings(VocabParallelHead(head_shard, vocab_size, world))
    return True
