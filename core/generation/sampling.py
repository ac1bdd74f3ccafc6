"""Choosing the next token: argmax when greedy, else a seeded draw that needs no random-number state.

A draw uses the "exponential race" (gpt-fast's ``multinomial_sample_one_no_sync``): with ``q`` exponential
noise, ``argmax(probs / q)`` picks token ``i`` with probability ``probs[i]``, and unlike
``torch.multinomial`` it never waits for the host, so it can sit inside a captured graph. The noise is not
drawn from a generator: it is a hash of (seed, the row's prompt number, the step, the token id), computed
with integer arithmetic on the device. So a row's draws depend on nothing but the seed, which prompt it is
and how far it has got: not on the batch it shares, where that batch starts, the batch size, or what ran
before. A resumed run therefore samples exactly what an uninterrupted one did, and a captured graph holds
no generator state to register or advance.

Shapes: B batch, V vocabulary.
"""

from __future__ import annotations

import torch

from accelgen.common.settings import SamplingSettings

_MASK_32 = 0xFFFFFFFF


def logits_to_probs(logits: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """Probabilities [B, V] after temperature, top-k and top-p (nucleus) filtering, in that order."""
    logits = logits.float() / max(sampling.temperature, 1e-5)
    if sampling.top_k > 0:
        kth_largest = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # keep at least the most likely token (the last); no "[:, -1] = False", which copies a host scalar in
        keep_last = torch.zeros_like(cumulative[:, -1:], dtype=torch.bool)
        remove_sorted = torch.cat([cumulative[:, :-1] <= 1 - sampling.top_p, keep_last], dim=-1)
        remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)


def choose_tokens(
    logits: torch.Tensor, sampling: SamplingSettings, row_indices: torch.Tensor, step: torch.Tensor
) -> torch.Tensor:
    """Next token ids [B] from logits [B, V]: the most likely when greedy, else a seeded draw.

    ``row_indices`` [B] number each row's prompt and ``step`` [1] is the index of the token being chosen
    (0 for the first new token): with the seed they decide the draw (see the module docstring)."""
    if not sampling.do_sample:
        return logits.argmax(-1)
    probs = logits_to_probs(logits, sampling)
    noise = exponential_noise(sampling.seed, row_indices, step, probs.shape[-1])
    return (probs / noise).argmax(-1)


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The log-probability [B] of each row's chosen token under the model's own distribution (``log_softmax``
    of its logits, before temperature, top-k and top-p), computed on the device."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.unsqueeze(-1)).squeeze(-1)


def exponential_noise(seed: int, row_indices: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exponential(1) noise [B, V] that is a pure function of (seed, row index, step, token id).

    Integer arithmetic only, exact on every device (no product leaves int64's range), so the same inputs
    give the same noise on a CPU, a GPU or a Gaudi."""
    rows = row_indices.long()
    row_key = _hash32((rows & _MASK_32) ^ _hash32(((rows >> 32) & _MASK_32) ^ _seed_key(seed)))  # [B]
    step_key = _hash32(row_key ^ _hash32(step.long() & _MASK_32))  # [B]
    token_key = _hash32(torch.arange(vocab_size, device=row_indices.device, dtype=torch.long))  # [V]
    bits = _hash32(step_key.unsqueeze(-1) ^ token_key)  # [B, V], uniform over 32 bits
    # the top 24 bits fit a float32 exactly: uniform in (0, 1), never 0 or 1
    uniform = ((bits >> 8).float() + 0.5) / float(1 << 24)
    return -torch.log(uniform)


def _seed_key(seed: int) -> int:
    """A 32-bit key for a 64-bit seed, computed on the host (Python integers) when the step is built."""
    key = 0x9E3779B9
    seed = int(seed) & ((1 << 64) - 1)
    for word in (seed & _MASK_32, seed >> 32):
        key = _hash32(key ^ word)
    return key


def _hash32(values):
    """Chris Wellons' "lowbias32" integer hash of 32-bit values: int64 tensors, or Python integers."""
    values = values ^ (values >> 16)
    values = _multiply_32(values, 0x7FEB352D)
    values = values ^ (values >> 15)
    values = _multiply_32(values, 0x846CA68B)
    return values ^ (values >> 16)


def _multiply_32(values, constant: int):
    """``values * constant`` modulo 2**32 for 32-bit ``values``, in two 16-bit halves of the constant so that
    no intermediate product exceeds 2**48 (a plain product could overflow int64, whose wrap-around torch
    does not promise)."""
    low, high = constant & 0xFFFF, constant >> 16
    return (values * low + ((values * high & 0xFFFF) << 16)) & _MASK_32
