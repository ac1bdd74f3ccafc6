"""Vocabulary-parallel input embedding and output head for tensor-parallel inference.

DeepSpeed's AutoTP leaves the input embedding whole on every rank and gives the output head a
separate (untied) copy split along the hidden size, so a rank of a tied-embedding model such as
BLOOM holds the vocabulary matrix twice over: for BLOOM-560m that is 0.96x of the unsharded model
per rank at 2 ranks. Here each rank keeps one slice of the vocabulary rows, shared by the embedding
and (for tied models) the head, and the collectives put the full results back together:

- embedding: each rank embeds the ids in its slice (zeros elsewhere); an all-reduce sums them.
- head: each rank computes the logits of its slice; an all-gather concatenates them.

Both results equal the unsharded ones exactly: each value is computed on one rank, others add zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from accelgen.settings import World


def vocabulary_slice(vocab_size: int, world: World) -> tuple[int, int, int]:
    """(first row, rows held, rows allotted) of this rank; the last rank's allotment is zero-padded."""
    allotted = -(-vocab_size // world.size)
    first = world.rank * allotted
    held = max(0, min(vocab_size, first + allotted) - first)
    return first, held, allotted


def _slice_rows(full_weight: torch.Tensor, world: World) -> tuple[torch.Tensor, int]:
    first, held, allotted = vocabulary_slice(full_weight.shape[0], world)
    shard = full_weight.new_zeros((allotted, full_weight.shape[1]))
    shard[:held] = full_weight[first : first + held]
    return shard, first


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` whose rows are split over the ranks. input_ids [*] -> embeddings [*, H]."""

    def __init__(self, full_weight: torch.Tensor, world: World):
        super().__init__()
        shard, self.first_row = _slice_rows(full_weight.detach(), world)
        self.weight = nn.Parameter(shard, requires_grad=False)
        self.vocab_size = full_weight.shape[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.first_row
        elsewhere = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        embedded = F.embedding(local_ids.masked_fill(elsewhere, 0), self.weight)
        embedded = embedded.masked_fill(elsewhere.unsqueeze(-1), 0)
        torch.distributed.all_reduce(embedded)
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


def split_vocabulary(model: nn.Module, input_embedding: torch.Tensor, output_head: torch.Tensor | None, world: World) -> None:
    """Replace ``model``'s embedding and head by vocabulary-parallel ones, built from the unsharded
    weights (``output_head`` None when the head is tied to the embedding, or has a bias we keep)."""
    embedding = VocabParallelEmbedding(input_embedding, world)
    model.set_input_embeddings(embedding)
    if output_head is None:
        head_shard = embedding.weight
    else:
        head_shard = nn.Parameter(_slice_rows(output_head.detach(), world)[0], requires_grad=False)
    model.set_output_embeddings(VocabParallelHead(head_shard, embedding.vocab_size, world))
