"""Small pure functions of the static-shape generation loop, in the order they run.

Shapes: B is the fixed batch size, P the prompt bucket length, L the cache length (P + new tokens),
V the vocabulary size.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from accelgen.errors import UsageError
from accelgen.settings import SamplingSettings


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


def logits_to_probs(logits: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """Probabilities [B, V] after temperature, top-k and top-p (nucleus) filtering, in that order."""
    logits = logits.float() / max(sampling.temperature, 1e-5)
    if sampling.top_k > 0:
        kth_largest = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cumulative <= 1 - sampling.top_p
        remove_sorted[:, -1] = False  # keep at least the most likely token
        remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)


def sample(logits: torch.Tensor, sampling: SamplingSettings, generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids [B] from logits [B, V]: argmax when greedy, else a seeded draw."""
    if not sampling.do_sample:
        return logits.argmax(-1)
    probs = logits_to_probs(logits, sampling)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def decode_one_token(
    decode_step: Callable[..., torch.Tensor],
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor,
    sampling: SamplingSettings,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Run the (captured) step for the token in ``input_ids`` [B, 1] and return the next tokens [B].

    ``cache_position`` [1] is where that token's keys and values go; the mask [B, L] opens it first.
    """
    attention_mask.index_fill_(1, cache_position, 1)
    logits = decode_step(input_ids, position_ids, cache_position, attention_mask)
    return sample(logits, sampling, generator)


def advance(
    input_ids: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor, next_tokens: torch.Tensor
) -> None:
    """Move the static decode buffers on by one token, in place (their addresses must not change)."""
    input_ids.copy_(next_tokens.unsqueeze(-1))
    position_ids.add_(1)
    cache_position.add_(1)
