"""Small pure functions of the static-shape generation loop, in the order they run (gpt-fast's shape).

``prefill`` runs the padded prompts and chooses each row's first token; ``start_decoding`` sets the
static buffers from it; ``decode_one_token`` is the whole decode step: the forward pass, the token
choice, the end-of-sequence bookkeeping and the advance of every position, all on the device and
in place, so that an accelerator can capture it once and replay it; ``decode_n_tokens`` replays it and
only looks at the device every few steps, to stop once every row has finished.

Shapes: B is the fixed batch size, P the prompt bucket length, L the cache length (P + new tokens),
N the new tokens, V the vocabulary size.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import torch

from accelgen.common.errors import UsageError
from accelgen.common.settings import SamplingSettings
from accelgen.generation.sampling import choose_tokens

#: ``forward(input_ids [B, T], attention_mask [B, L], position_ids [B, T], cache_position [T]) -> logits [B, V]``
#: of the last position, writing the keys and values of the T tokens into the KV cache.
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecodeState(NamedTuple):
    """The fixed-address buffers of one static shape. The decode step reads and writes nothing else
    (besides the KV cache), so a graph captured over them replays correctly for every token."""

    input_ids: torch.Tensor  # [B, 1] the token being decoded
    position_ids: torch.Tensor  # [B, 1] its position, counting real tokens only
    cache_position: torch.Tensor  # [1] where its keys and values are written
    attention_mask: torch.Tensor  # [B, L] 1 where a row may attend
    step: torch.Tensor  # [1] index in new_tokens of the token being chosen
    new_tokens: torch.Tensor  # [B, N] the tokens chosen so far; a finished row continues with padding
    finished: torch.Tensor  # [B] rows that have produced an end-of-sequence token
    row_indices: torch.Tensor  # [B] each row's prompt number, which decides its sampling draws

    @classmethod
    def allocate(cls, batch_size: int, cache_length: int, new_tokens: int, device: torch.device) -> "DecodeState":
        longs = long_zeros(device)
        return cls(
            input_ids=longs(batch_size, 1), position_ids=longs(batch_size, 1), cache_position=longs(1),
            attention_mask=longs(batch_size, cache_length), step=longs(1), new_tokens=longs(batch_size, new_tokens),
            finished=torch.zeros(batch_size, dtype=torch.bool, device=device), row_indices=longs(batch_size),
        )


def long_zeros(device: torch.device) -> Callable[..., torch.Tensor]:
    """``longs(*shape)``: a new int64 buffer of zeros on ``device``."""
    return lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)


@dataclasses.dataclass(frozen=True)
class TokenRules:
    """How tokens are chosen and when a row stops."""

    sampling: SamplingSettings
    eos_token_ids: torch.Tensor  # [E] on the device; a row that produces one has finished
    pad_token_id: int  # what a finished row produces from then on
    stop_at_eos: bool  # False with ignore_eos: every row produces every new token


def choose_bucket(longest_prompt: int, buckets: Sequence[int], context_limit: int | None, new_tokens: int) -> int:
    """The smallest bucket that holds the longest prompt, shrunk to fit the model's context if needed."""
    fitting = [bucket for bucket in sorted(buckets) if bucket >= longest_prompt]
    if not fitting:
        raise UsageError(
            f"A prompt has {longest_prompt} tokens, more than the largest bucket ({max(buckets)}): "
            f"pass --max-input-tokens N to keep its first N tokens, or a larger bucket with --buckets."
        )
    bucket = fitting[0]
    if context_limit is not None and bucket + new_tokens > context_limit:
        bucket = context_limit - new_tokens
        if bucket < longest_prompt:
            raise UsageError(
                f"A prompt of {longest_prompt} tokens plus {new_tokens} new tokens exceeds the model's "
                f"context of {context_limit} positions: lower --max-new-tokens or pass --max-input-tokens."
            )
    return bucket


def left_pad(
    prompts: Sequence[Sequence[int]], bucket_length: int, batch_size: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, P] with each prompt right-aligned, and the prompt mask [B, P] (1 = real token).

    Missing batch rows repeat the first prompt (a fully masked row could turn attention into NaN);
    the caller drops their output.
    """
    rows = list(prompts) + [prompts[0]] * (batch_size - len(prompts))
    input_ids = torch.full((batch_size, bucket_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((batch_size, bucket_length), dtype=torch.long)
    for row, token_ids in enumerate(rows):
        if token_ids:
            input_ids[row, -len(token_ids) :] = torch.tensor(token_ids, dtype=torch.long)
            prompt_mask[row, -len(token_ids) :] = 1
    return input_ids, prompt_mask


def positions_from_mask(prompt_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, P] counting real tokens only, as Hugging Face ``generate`` does for left padding."""
    positions = prompt_mask.cumsum(-1) - 1
    return positions.masked_fill(prompt_mask == 0, 1)


def prefill(
    forward: Forward, state: DecodeState, input_ids: torch.Tensor, prompt_mask: torch.Tensor, rules: TokenRules
) -> torch.Tensor:
    """Run the padded prompts input_ids [B, P] through the model, filling the KV cache, and return each
    row's first new token [B]. ``state.attention_mask`` must already hold the prompt mask [B, P] in front."""
    bucket_length = input_ids.shape[1]
    logits = forward(
        input_ids, state.attention_mask, positions_from_mask(prompt_mask),
        torch.arange(bucket_length, device=input_ids.device),
    )
    state.step.zero_()
    return choose_tokens(logits, rules.sampling, state.row_indices, state.step)


def start_decoding(state: DecodeState, first_tokens: torch.Tensor, prompt_lengths: torch.Tensor, rules: TokenRules) -> None:
    """Set the decode buffers after a prefill: ``first_tokens`` [B] recorded, each row at its prompt's end
    (``prompt_lengths`` [B, 1]), the next keys and values to be written just after the bucket."""
    state.new_tokens.fill_(rules.pad_token_id)
    state.finished.zero_()
    state.step.zero_()
    record_tokens(state, first_tokens, rules)
    state.input_ids.copy_(first_tokens.unsqueeze(-1))
    state.position_ids.copy_(prompt_lengths)
    state.cache_position.fill_(state.attention_mask.shape[1] - state.new_tokens.shape[1])
    state.step.fill_(1)


def decode_one_token(forward: Forward, state: DecodeState, rules: TokenRules) -> torch.Tensor:
    """The whole decode step, in place on ``state``: attend from the token in ``input_ids`` (its keys and
    values join the cache), choose the next token [B], record it, and move every position on by one.
    Nothing here waits for the host, so an accelerator can capture the step as one graph."""
    state.attention_mask.index_fill_(1, state.cache_position, 1)  # the token attends to itself
    logits = forward(state.input_ids, state.attention_mask, state.position_ids, state.cache_position)
    next_tokens = choose_tokens(logits, rules.sampling, state.row_indices, state.step)
    next_tokens = record_tokens(state, next_tokens, rules)
    state.input_ids.copy_(next_tokens.unsqueeze(-1))
    state.position_ids.add_(1)
    state.cache_position.add_(1)
    state.step.add_(1)
    return next_tokens


def record_tokens(state: DecodeState, tokens: torch.Tensor, rules: TokenRules) -> torch.Tensor:
    """Write ``tokens`` [B] at ``state.step`` of ``new_tokens``, padding for rows that had finished, and mark
    the rows that end here. Returns the tokens as recorded."""
    if rules.stop_at_eos:
        tokens = tokens.masked_fill(state.finished, rules.pad_token_id)
        state.finished.logical_or_(torch.isin(tokens, rules.eos_token_ids))
    state.new_tokens.index_copy_(1, state.step, tokens.unsqueeze(-1))
    return tokens


def decode_n_tokens(
    decode_step: Callable[..., object], state: DecodeState, steps: int, stop_when_finished: bool,
    check_every: int, after_step: Callable[[], None],
) -> int:
    """Replay ``decode_step(*state)`` up to ``steps`` times and return how many ran. With
    ``stop_when_finished``, every ``check_every`` steps the host reads whether every row has finished
    (the only wait for the device) and stops early if so. ``after_step()`` follows each replay."""
    for done in range(steps):
        if stop_when_finished and done and done % check_every == 0 and bool(state.finished.all()):
            return done
        decode_step(*state)
        after_step()
    return steps
