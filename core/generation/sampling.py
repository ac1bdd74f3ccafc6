"""Choosing the next token: argmax when greedy, else a seeded draw that needs no random-number state.

A draw is an inverse-CDF draw: one uniform number ``u`` per row, and the first token whose cumulative probability
exceeds ``u`` times the total. Unlike ``torch.multinomial`` it never waits for the host, so it can sit inside a
captured graph, and it needs one random number per row, not one per token of the vocabulary (the "exponential race"
of gpt-fast, used here before, hashes every row x token: 1.9 ms of a 9 ms CPU decode step at 16 rows x 4,096 tokens,
against about 40 us for a cumulative sum and a count). The number is not drawn from a generator: it is a hash of
(seed, the row's prompt number, the step), computed with integer arithmetic on the device. So a row's draws depend
on nothing but the seed, which prompt it is and how far it has got: not on the batch it shares, where that batch
starts, the batch size, or what ran before. A resumed run therefore samples exactly what an uninterrupted one did,
and a captured graph holds no generator state to register or advance. The hash takes some eighty small integer
operations, which a decode step does not run: it reads each row's number from a table of its every step's numbers
(:func:`uniform_draws` over [rows, steps]), made when the row starts.

Shapes: B batch, V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from accelgen.common.settings import SamplingSettings
from accelgen.common.static_sizes import static_shape
from accelgen.plugin.contract import TokenDraw

_MASK_32 = 0xFFFFFFFF


class RowSampling(NamedTuple):
    """Each row's own sampling settings, on the device (rows of an OpenAI batch file choose theirs; otherwise
    every row holds the run's)."""

    temperatures: torch.Tensor  # [B] float32; 0 makes a row greedy where rows choose (``per_row``)
    top_ps: torch.Tensor  # [B] float32; 1: no nucleus filtering
    seed_keys: torch.Tensor  # [B] int64: each row's :func:`seed_key`

    @classmethod
    def of_run(cls, sampling: SamplingSettings, rows: int, device: torch.device) -> "RowSampling":
        """The run's settings for ``rows`` rows."""
        return cls(torch.full((rows,), sampling.temperature, dtype=torch.float32, device=device),
                   torch.full((rows,), sampling.top_p, dtype=torch.float32, device=device),
                   torch.full((rows,), seed_key(sampling.seed), dtype=torch.long, device=device))


def logits_to_weights(logits: torch.Tensor, sampling: SamplingSettings, rows: RowSampling | None = None,
                      per_row: bool = False, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's weight [B, V]: its probability after temperature, top-k and top-p (nucleus) filtering, in that
    order, times a row's own constant (the most likely token weighs 1, a filtered one 0); what a draw needs, without
    the division a normalised distribution costs. The run's top-k, each row's temperature and top-p (``rows``;
    default: the run's). Top-p sorts the vocabulary, so it runs only where a row may use it: the run's top-p is
    below 1, or rows choose their own (``per_row``). ``allowed`` [B, V] (bool): only those tokens may be drawn (rows held to
    a structure); the others weigh 0."""
    rows = rows if rows is not None else RowSampling.of_run(sampling, logits.shape[0], logits.device)
    logits = logits.float()
    if allowed is not None:
        logits = torch.where(allowed, logits, float("-inf"))
    # shifted to a largest of 0 before the temperature divides them (as a product by its inverse): the same
    # distribution, and no exponential overflows
    logits = (logits - logits.amax(-1, keepdim=True)) * inverse_temperatures(rows).unsqueeze(-1)
    if sampling.top_k > 0:
        kth_largest = torch.topk(logits, min(sampling.top_k, static_shape(logits)[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p < 1.0 or per_row:
        sorted_logits, sorted_indices = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # keep at least the most likely token (the last); no "[:, -1] = False", which copies a host scalar in
        keep_last = torch.zeros_like(cumulative[:, -1:], dtype=torch.bool)
        remove_sorted = torch.cat([cumulative[:, :-1] <= 1 - rows.top_ps.unsqueeze(-1), keep_last], dim=-1)
        remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    if filters_nothing(sampling, per_row, allowed):
        return logits.exp()
    # most tokens are -inf here, which torch's CPU exp takes a slow path for (as any result below float32's smallest
    # normal number): those weigh 0 without it
    return torch.where(logits < SMALLEST_EXPONENT, 0.0, logits.clamp(min=SMALLEST_EXPONENT).exp())


def filters_nothing(sampling: SamplingSettings, per_row: bool, allowed: torch.Tensor | None) -> bool:
    """Whether a draw takes every token by its probability after temperature: no top-k, no top-p (the run's, or the
    rows' own), no structure."""
    return allowed is None and sampling.top_k <= 0 and not (sampling.top_p < 1.0 or per_row)


def inverse_temperatures(rows: RowSampling) -> torch.Tensor:
    """Each row's 1 / temperature [B], what its logits are multiplied by (a temperature of 0 taken as 1e-5)."""
    return 1 / rows.temperatures.clamp(min=1e-5)


#: The smallest x whose exp(x) is a normal float32 number.
SMALLEST_EXPONENT = -87.0


def logits_to_probs(logits: torch.Tensor, sampling: SamplingSettings, rows: RowSampling | None = None,
                    per_row: bool = False) -> torch.Tensor:
    """Probabilities [B, V] after temperature, top-k and top-p filtering: :func:`logits_to_weights`, normalised."""
    weights = logits_to_weights(logits, sampling, rows, per_row)
    return weights / weights.sum(-1, keepdim=True)


def choose_tokens(logits: torch.Tensor, sampling: SamplingSettings, uniform: torch.Tensor,
                  rows: RowSampling | None = None, per_row: bool = False, allowed: torch.Tensor | None = None,
                  device_draw: TokenDraw | None = None) -> torch.Tensor:
    """Next token ids [B] from logits [B, V]: the most likely when greedy, else a seeded draw.

    ``uniform`` [B] is each row's number for its draw (:func:`uniform_draws` of its seed, prompt number and step;
    see the module docstring), unread when greedy. ``rows``: each row's temperature and top-p (default: the
    run's). With ``per_row`` the rows choose
    (an OpenAI batch file's requests): a row of temperature 0 is greedy, the others draw, whatever the run's
    ``do_sample``. ``allowed`` [B, V] (bool): each row chooses among those tokens only (its structure's).
    ``device_draw``: the device's own operator for the draw where nothing is filtered out
    (``Accelerator.token_draw``), in place of the torch operations of :func:`logits_to_weights` and :func:`draw`."""
    if not (sampling.do_sample or per_row):
        return most_likely(logits, allowed)
    rows = rows if rows is not None else RowSampling.of_run(sampling, logits.shape[0], logits.device)
    if device_draw is not None and filters_nothing(sampling, per_row, allowed):
        return device_draw(logits, inverse_temperatures(rows), uniform)
    drawn = draw(logits_to_weights(logits, sampling, rows, per_row, allowed), uniform)
    return torch.where(rows.temperatures > 0, drawn, most_likely(logits, allowed)) if per_row else drawn


def most_likely(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The argmax [B] of logits [B, V] (among the ``allowed`` [B, V] tokens, when given), taken in float32: the same
    token (the conversion is exact), and torch's CPU argmax over bfloat16 is 4x slower than a conversion and an argmax
    over float32."""
    logits = logits.float()
    return (logits if allowed is None else torch.where(allowed, logits, float("-inf"))).argmax(-1)


#: tokens per block of :func:`draw`
DRAW_BLOCK = 64


def draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Token ids [B]: for each row of ``weights`` [B, V] (non-negative, some positive: probabilities, or any multiple
    of them) the first token whose cumulative weight exceeds ``uniform`` [B] (in (0, 1]) times the row's total. A
    token of weight 0 is never drawn.

    By blocks of :data:`DRAW_BLOCK` tokens: the cumulative sum of the blocks' totals finds the block the mark falls
    in, and the cumulative sum of that block's weights the token in it. A cumulative sum adds one value after
    another; these add V / 64 and 64 a row where one over the row adds V. Counts, not searches, so that every device
    runs them. Where rounding puts the mark at or past the end of the weight (of the row, or of the block it falls
    in), the draw takes the last token of any weight there."""
    rows, width = static_shape(weights)
    blocks = -(-width // DRAW_BLOCK)
    weights = weights.float()
    if blocks * DRAW_BLOCK != width:  # tokens of weight 0 after the last
        weights = torch.nn.functional.pad(weights, (0, blocks * DRAW_BLOCK - width))
    blocked = weights.view(rows, blocks, DRAW_BLOCK)
    block_totals = blocked.sum(-1)  # [B, blocks]
    block_ends = block_totals.cumsum(-1)  # [B, blocks]: the cumulative weight at each block's end
    mark = uniform.unsqueeze(-1) * block_ends[:, -1:]  # [B, 1]
    block = torch.minimum((block_ends <= mark).sum(-1), _last_true(block_totals > 0))  # [B]
    before = torch.where(block > 0, block_ends.gather(1, (block - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    inner = blocked.gather(1, block.view(rows, 1, 1).expand(rows, 1, DRAW_BLOCK)).squeeze(1)  # [B, DRAW_BLOCK]
    within = (inner.cumsum(-1) + before.unsqueeze(-1) <= mark).sum(-1)  # a token of weight 0 adds nothing: never past
    return block * DRAW_BLOCK + torch.minimum(within, _last_true(inner > 0))


def _last_true(flags: torch.Tensor) -> torch.Tensor:
    """The index [B] of the last True of each row of ``flags`` [B, N] (0 where none is)."""
    return (torch.arange(flags.shape[-1], device=flags.device) * flags).amax(-1)


def allowed_tokens(allowed: torch.Tensor, width: int) -> torch.Tensor:
    """Which of ``width`` tokens each row may take [B, width] (bool), from ``allowed`` [B, W] int32: bit t % 32 of word
    t // 32 is set where token t is allowed (W * 32 >= width; a row of -1 allows all). Device operations only."""
    bit_values = torch.ones(32, dtype=torch.int32, device=allowed.device).bitwise_left_shift_(
        torch.arange(32, dtype=torch.int32, device=allowed.device))  # [32]: 1, 2, 4, ... (made on the device: capturable)
    return (allowed.unsqueeze(-1) & bit_values).view(allowed.shape[0], -1)[:, :width] != 0


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The log-probability [B] of each row's chosen token under the model's own distribution (``log_softmax``
    of its logits, before temperature, top-k and top-p), computed on the device."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.unsqueeze(-1)).squeeze(-1)


def uniform_draws(seed_keys: torch.Tensor, row_indices: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """A uniform number in (0, 1] (float32) that is a pure function of (seed, row index, step), for each element of
    the three int64 tensors broadcast together: ``seed_keys`` are the rows' seeds as :func:`seed_key` makes them.
    Rows [B] at one step [1] give [B]; rows [B, 1] and steps [1, N] give every step's number of every row [B, N].

    Integer arithmetic only, exact on every device (no product leaves int64's range), so the same inputs give the
    same number on a CPU, a GPU or a Gaudi."""
    rows = row_indices.long()
    row_key = _hash32((rows & _MASK_32) ^ _hash32(((rows >> 32) & _MASK_32) ^ seed_keys))  # [B]
    bits = _hash32(row_key ^ _hash32(step.long() & _MASK_32))  # [B], uniform over 32 bits
    # the top 24 bits, and a half: uniform in (0, 1], never 0; the largest rounds to 1 in float32 (a draw at 1 takes
    # its row's last token of any weight)
    return ((bits >> 8).float() + 0.5) / float(1 << 24)


def seed_key(seed: int) -> int:
    """A 32-bit key for a 64-bit seed, computed on the host (Python integers) when a row starts."""
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
