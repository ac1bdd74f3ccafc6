"""Small pure functions of continuous batching inside one static shape (gpt-fast's shape, as ``decoding``).

The decode step keeps one shape, B rows over a cache of L positions, but each row is a *slot*: it holds one
prompt from the moment that prompt is inserted until its completion ends, with its own cache write
position, position id, step and prompt number. ``insert_rows`` puts prefilled prompts into free slots (the
host does that between steps, with device operations on the same buffers); ``decode_one_slot_token`` is
the whole decode step, per row and in place, so an accelerator captures it once and replays it whatever
the rows inside it are; ``finished_slots`` is what the host reads every few steps to free slots.

A row that has finished (end-of-sequence, or its ``max_new_tokens``) or a slot that holds nothing goes on
being computed, as padding in a static batch is, until the host gives the slot a new prompt: its tokens
go to a spare column of ``new_tokens`` and its cache writes stay inside its own row.

Shapes: B slots, L cache positions, N new tokens per row (``new_tokens`` has N + 1 columns: the last is
where a finished row's tokens go), P a prompt bucket, k the rows of a prefill shape.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from accelgen.generation.decoding import Forward, TokenRules, long_zeros
from accelgen.generation.sampling import choose_tokens


class SlotState(NamedTuple):
    """The fixed-address buffers of the slot step. It reads and writes nothing else (besides the KV cache,
    whose per-row writes go to ``write_positions``), so one graph captured over them serves every row."""

    input_ids: torch.Tensor  # [B, 1] the token being decoded in each slot
    position_ids: torch.Tensor  # [B, 1] its position among the row's real tokens
    write_positions: torch.Tensor  # [B] where in its row of the cache its keys and values go
    attention_mask: torch.Tensor  # [B, L] 1 where a row may attend
    steps: torch.Tensor  # [B] index in new_tokens of the token being chosen; N once the row has finished
    new_tokens: torch.Tensor  # [B, N + 1] each row's tokens so far; column N takes a finished row's tokens
    finished: torch.Tensor  # [B] the row has ended (or the slot holds nothing)
    row_indices: torch.Tensor  # [B] each row's prompt number, which decides its sampling draws

    @classmethod
    def allocate(cls, slots: int, cache_length: int, new_tokens: int, device: torch.device) -> "SlotState":
        longs = long_zeros(device)
        return cls(
            input_ids=longs(slots, 1), position_ids=longs(slots, 1), write_positions=longs(slots),
            attention_mask=longs(slots, cache_length), steps=torch.full((slots,), new_tokens, dtype=torch.long, device=device),
            new_tokens=longs(slots, new_tokens + 1), finished=torch.ones(slots, dtype=torch.bool, device=device),
            row_indices=longs(slots),
        )

    @property
    def max_new_tokens(self) -> int:
        return self.new_tokens.shape[1] - 1


def insert_rows(
    state: SlotState, slots: torch.Tensor, first_tokens: torch.Tensor, prompt_mask: torch.Tensor,
    row_indices: torch.Tensor, rules: TokenRules,
) -> None:
    """Give ``slots`` [k] new rows whose prompts (mask [k, P], their keys and values already at positions
    [0, P) of those rows of the cache) chose ``first_tokens`` [k]: each row attends to its prompt, decodes
    next at position P, and has recorded its first token (it may have finished with it)."""
    bucket_length = prompt_mask.shape[1]
    state.attention_mask.index_fill_(0, slots, 0)
    state.attention_mask[:, :bucket_length].index_copy_(0, slots, prompt_mask)
    state.write_positions.index_fill_(0, slots, bucket_length)
    state.position_ids.index_copy_(0, slots, prompt_mask.sum(-1, keepdim=True))
    state.input_ids.index_copy_(0, slots, first_tokens.unsqueeze(-1))
    state.row_indices.index_copy_(0, slots, row_indices)
    state.new_tokens.index_fill_(0, slots, rules.pad_token_id)
    state.new_tokens[:, 0].index_copy_(0, slots, first_tokens)
    ended = torch.full_like(first_tokens, state.max_new_tokens <= 1, dtype=torch.bool)
    if rules.stop_at_eos:
        ended |= torch.isin(first_tokens, rules.eos_token_ids)
    state.finished.index_copy_(0, slots, ended)
    state.steps.index_copy_(0, slots, torch.where(ended, state.max_new_tokens, 1))


def decode_one_slot_token(forward: Forward, state: SlotState, rules: TokenRules) -> torch.Tensor:
    """The whole slot step, in place on ``state``: every row attends from its token in ``input_ids`` (whose
    keys and values join its row of the cache at ``write_positions``), chooses its next token [B], records
    it, and moves its own positions on by one. Nothing here waits for the host."""
    cache_length = state.attention_mask.shape[1]
    state.attention_mask.scatter_(1, state.write_positions.unsqueeze(-1), 1)  # each token attends to itself
    # the model sees the last cache position as every query's: the mask alone says what each row sees
    last_position = torch.full((1,), cache_length - 1, dtype=torch.long, device=state.input_ids.device)
    logits = forward(state.input_ids, state.attention_mask, state.position_ids, last_position)
    next_tokens = choose_tokens(logits, rules.sampling, state.row_indices, state.steps)
    next_tokens = record_slot_tokens(state, next_tokens, rules)
    state.input_ids.copy_(next_tokens.unsqueeze(-1))
    state.position_ids.add_(1)
    state.write_positions.add_(1).clamp_(max=cache_length - 1)  # a finished row writes on in its own row
    return next_tokens


def record_slot_tokens(state: SlotState, tokens: torch.Tensor, rules: TokenRules) -> torch.Tensor:
    """Write ``tokens`` [B] at each row's step of ``new_tokens`` (a finished row's into the spare column, as
    padding), mark the rows that end here (end-of-sequence, or their last new token), advance the steps."""
    last = state.max_new_tokens
    tokens = tokens.masked_fill(state.finished, rules.pad_token_id)
    state.new_tokens.scatter_(1, state.steps.unsqueeze(-1), tokens.unsqueeze(-1))
    ends = state.steps >= last - 1
    if rules.stop_at_eos:
        ends |= torch.isin(tokens, rules.eos_token_ids)
    state.finished.logical_or_(ends)
    state.steps.add_(1).masked_fill_(state.finished, last)
    return tokens
