"""Small pure functions of the decode loop, in the order they run (gpt-fast's shape), over one state type.

The decode step keeps one shape, B rows over a cache of L positions, and each row is a *slot*: it holds one
prompt from the moment the prompt is inserted until its completion ends, with its own cache write position,
position id, step and the numbers its sampling draws are made from. ``prefill`` runs k padded prompts and chooses
each one's first token; ``insert_rows`` puts them into free slots (between steps, with device operations on the
same buffers); ``decode_one_token`` is the whole decode step, per row and in place (the forward pass, the token choice, the
end-of-sequence bookkeeping and the advance of every position), so an accelerator captures it once and
replays it whatever rows are inside it. A fixed batch is B rows inserted together, decoded until all end.

A row that has finished (end-of-sequence, or its ``max_new_tokens``) or a slot that holds nothing goes on
being computed, as padding in a static batch is, until the host gives the slot a new prompt: its tokens go
to a spare column of ``new_tokens`` and its cache writes stay inside its own row.

Shapes: B slots, L cache positions, N new tokens per row (``new_tokens`` has N + 1 columns: the last is
where a finished row's tokens go), P a prompt bucket, k the rows of a prefill shape, V the vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import torch

from accelgen.common.errors import UsageError
from accelgen.common.settings import SamplingSettings
from accelgen.generation.sampling import RowSampling, allowed_tokens, choose_tokens, chosen_logprobs, uniform_draws
from accelgen.plugin.contract import TokenDraw

#: ``forward(input_ids [B, T], attention_mask [B, L], position_ids [B, T], cache_position [T]) -> logits [B, V]``
#: of the last position, writing the keys and values of the T tokens into the KV cache it is bound to.
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: prompts packed in one row: (input_ids [1, N], prompt_of [N], position_ids [1, N], ends [k], token_positions [N])
#: -> the logits [k, V] of each prompt's last token (``run_packed_prompts``)
PackedForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

PREFILL_POSITION_STEP = 8  # an eager prefill's positions are a multiple of this (see ``padded_length``)


class DecodeState(NamedTuple):
    """The fixed-address buffers of the decode step. It reads and writes nothing else (besides the KV cache,
    whose rows are written at ``write_positions``), so one graph captured over them serves every row."""

    input_ids: torch.Tensor  # [B, 1] the token being decoded in each slot
    position_ids: torch.Tensor  # [B, 1] its position among the row's real tokens
    write_positions: torch.Tensor  # [B] where in its row of the cache its keys and values go
    attention_mask: torch.Tensor  # [B, L] 1 where a row may attend
    steps: torch.Tensor  # [B] index in new_tokens of the token being chosen; N once the row has finished
    new_tokens: torch.Tensor  # [B, N + 1] each row's tokens so far; column N takes a finished row's tokens
    finished: torch.Tensor  # [B] the row has ended (or the slot holds nothing)
    uniforms: torch.Tensor  # [B, N + 1] float32: each row's number for its draw at each step (unused when greedy)
    logprobs: torch.Tensor  # [B, N + 1] float32: each chosen token's log-probability (written with --logprobs)
    limits: torch.Tensor  # [B] each row's own maximum of new tokens (at most N)
    temperatures: torch.Tensor  # [B] float32 \
    top_ps: torch.Tensor  # [B] float32         } each row's sampling (``sampling.RowSampling``)
    seed_keys: torch.Tensor  # [B] int64         /
    allowed: torch.Tensor  # [B, W] int32: the tokens each row may take next, a bit each (``TokenRules.constrained``)
    adapter_slots: torch.Tensor  # [B] the buffer slot of each row's LoRA adapter (0: the base model's)

    @classmethod
    def allocate(cls, slots: int, cache_length: int, new_tokens: int, device: torch.device,
                 mask_words: int = 0) -> "DecodeState":
        """Buffers for ``slots`` rows; ``mask_words`` words of 32 tokens in a row of ``allowed`` (0: no mask)."""
        longs, floats = long_zeros(device), lambda *shape: torch.zeros(shape, dtype=torch.float32, device=device)
        return cls(
            input_ids=longs(slots, 1), position_ids=longs(slots, 1), write_positions=longs(slots),
            attention_mask=longs(slots, cache_length), steps=torch.full((slots,), new_tokens, dtype=torch.long, device=device),
            new_tokens=longs(slots, new_tokens + 1), finished=torch.ones(slots, dtype=torch.bool, device=device),
            uniforms=floats(slots, new_tokens + 1), logprobs=floats(slots, new_tokens + 1), limits=longs(slots),
            temperatures=floats(slots), top_ps=floats(slots), seed_keys=longs(slots),
            allowed=torch.full((slots, mask_words), -1, dtype=torch.int32, device=device), adapter_slots=longs(slots),
        )

    @property
    def sampling(self) -> RowSampling:
        return RowSampling(self.temperatures, self.top_ps, self.seed_keys)

    @property
    def max_new_tokens(self) -> int:
        return self.new_tokens.shape[1] - 1


def long_zeros(device: torch.device) -> Callable[..., torch.Tensor]:
    """``longs(*shape)``: a new int64 buffer of zeros on ``device``."""
    return lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)


@dataclasses.dataclass(frozen=True)
class TokenRules:
    """How tokens are chosen and when a row stops."""

    sampling: SamplingSettings
    ending_tokens: torch.Tensor  # [N] bool on the device (:func:`ending_table`): a row that produces one has finished
    pad_token_id: int  # what a finished row produces from then on
    stop_at_eos: bool  # False with ignore_eos: every row produces every new token
    logprobs: bool = False  # record each chosen token's log-probability
    per_row: bool = False  # rows choose their own sampling (greedy or not, temperature, top-p, seed)
    constrained: bool = False  # rows may be held to a structure: tokens are chosen among those their mask allows
    device_draw: TokenDraw | None = None  # the device's own draw, where nothing is filtered (``choose_tokens``)


def ending_table(token_ids: list[int], device: torch.device) -> torch.Tensor:
    """TokenRules' ``ending_tokens`` for end-of-sequence ``token_ids``: True at each of them; its last entry,
    False, answers for every id from there on (:func:`ends_on`). A lookup per step, where ``isin`` over the ids
    (some models end on a hundred) cost 20 to 100 us a step on the CPU."""
    table = torch.zeros(max(token_ids, default=-1) + 2, dtype=torch.bool)
    table[token_ids] = True
    return table.to(device)


def ends_on(rules: TokenRules, tokens: torch.Tensor) -> torch.Tensor:
    """Whether each of ``tokens`` [k] ends its row [k] (an end-of-sequence token)."""
    return rules.ending_tokens.index_select(0, tokens.clamp(0, rules.ending_tokens.shape[0] - 1))


class RowStart(NamedTuple):
    """What starting k rows in their slots takes, per row [k]: its first token (and its log-probability), its
    prompt's mask [k, P], its draw key, its maximum of new tokens, its sampling and its adapter's buffer slot."""

    first_tokens: torch.Tensor
    first_logprobs: torch.Tensor
    prompt_mask: torch.Tensor
    draw_keys: torch.Tensor
    limits: torch.Tensor
    sampling: RowSampling
    adapter_slots: torch.Tensor


#: What shortens a conversation: it is never cut (``--max-input-tokens`` refuses it: cutting it would cut its
#: generation prompt), so the fix is the user's.
SHORTEN_CONVERSATION = "shorten the conversation (fewer or shorter messages, a shorter --system-prompt or chat template)"


def choose_bucket(longest_prompt: int, buckets: Sequence[int], context_limit: int | None, new_tokens: int,
                  conversation: bool = False) -> int:
    """The smallest bucket that holds the longest prompt, shrunk to fit the model's context if needed. A prompt too
    long is refused with the fixes that apply to it (``conversation``: a conversation's, which is never cut)."""
    what = "A conversation makes" if conversation else "A prompt has"
    fitting = [bucket for bucket in sorted(buckets) if bucket >= longest_prompt]
    if not fitting:
        fix = SHORTEN_CONVERSATION if conversation else "pass --max-input-tokens N to keep its first N tokens"
        raise UsageError(f"{what} {longest_prompt} tokens, more than the largest bucket ({max(buckets)}): {fix}, or "
                         f"pass a larger bucket with --buckets.")
    bucket = fitting[0]
    if context_limit is not None and bucket + new_tokens > context_limit:
        bucket = context_limit - new_tokens
        if bucket < longest_prompt:
            fix = f"{SHORTEN_CONVERSATION}, or" if conversation else "pass --max-input-tokens, or"
            subject = "A conversation" if conversation else "A prompt"
            raise UsageError(f"{subject} of {longest_prompt} tokens plus {new_tokens} new tokens exceeds the model's "
                             f"context of {context_limit} positions: {fix} lower --max-new-tokens.")
    return bucket


def left_pad(
    prompts: Sequence[Sequence[int]], bucket_length: int, batch_size: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, P] with each prompt right-aligned, and the prompt mask [B, P] (1 = real token).

    Missing rows repeat the first prompt (a fully masked row could turn attention into NaN); the caller
    drops their output.
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
    """Position ids [k, P] counting real tokens only, as Hugging Face ``generate`` does for left padding."""
    positions = prompt_mask.cumsum(-1) - 1
    return positions.masked_fill(prompt_mask == 0, 1)


def padded_length(longest_prompt: int) -> int:
    """The positions an eagerly run prefill computes for prompts of up to ``longest_prompt`` tokens: that many,
    rounded up to a multiple of 8 (fewer shapes), of the bucket's last positions; the padding before them is
    masked out as it would have been in the bucket."""
    return -(-longest_prompt // PREFILL_POSITION_STEP) * PREFILL_POSITION_STEP


def prefill_spans(bucket_length: int, window: int, longest_prompt: int, chunk: int) -> list[tuple[int, int]]:
    """The spans [start, end) of bucket positions a prefill runs, in order: the last ``window`` positions (every
    prompt's tokens not found stored) in one pass, or, when that is more than ``chunk`` positions (0: no limit), in
    passes of ``chunk`` ending at P, P - chunk, ... (fixed shapes, whatever the prompts' lengths), leaving out those
    before the longest prompt (padding alone)."""
    if not chunk or window <= chunk:
        return [(bucket_length - window, bucket_length)]
    first = bucket_length - min(window, -(-longest_prompt // chunk) * chunk)
    return [(max(end - chunk, first), end) for end in reversed(range(bucket_length, first, -chunk))]


def run_prompt_positions(forward: Forward, input_ids: torch.Tensor, prompt_mask: torch.Tensor, start: int,
                         end: int) -> torch.Tensor:
    """Run positions [start, end) of the padded prompts input_ids [k, P] (mask [k, P]) through ``forward``, which
    writes their keys and values; they attend to what the cache rows hold before ``start``. The logits [k, V] of
    position ``end`` - 1."""
    positions = positions_from_mask(prompt_mask)[:, start:end]
    return forward(input_ids[:, start:end], prompt_mask[:, :end], positions,
                   torch.arange(start, end, device=input_ids.device))


def run_packed_prompts(forward: PackedForward, input_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """Run the padded prompts input_ids [k, P] (mask [k, P]) through ``forward`` one after another in one row, their
    padding left out: each token with its prompt's number, its position id and its position in the bucket (where its
    keys and values go in its prompt's cache row). The logits [k, V] of each prompt's last token."""
    real = prompt_mask.bool()
    rows, length = prompt_mask.shape
    prompt_of = torch.arange(rows, device=input_ids.device)[:, None].expand(rows, length)[real]
    token_positions = torch.arange(length, device=input_ids.device)[None, :].expand(rows, length)[real]
    ends = prompt_mask.sum(-1).cumsum(0) - 1
    return forward(input_ids[real][None], prompt_of, positions_from_mask(prompt_mask)[real][None], ends, token_positions)


def prefill(forward: Forward, input_ids: torch.Tensor, prompt_mask: torch.Tensor, draw_from: torch.Tensor,
            draw_keys: torch.Tensor, sampling: RowSampling, rules: TokenRules, start: int = 0,
            packed: PackedForward | None = None, allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the padded prompts input_ids [k, P] (mask [k, P]) from position ``start`` on through ``forward``, which
    writes their keys and values (the positions before ``start`` are in the cache rows already: a stored prefix, or
    the chunks prefilled before), or whole and without their padding through ``packed`` (``run_packed_prompts``),
    and draw m first tokens [m] (step 0 of each draw): draw j from prompt ``draw_from[j]`` keyed by ``draw_keys[j]``
    (one per prompt, or one per sample of it) with its own ``sampling`` [m], among the tokens ``allowed`` [m, W] (with
    ``rules.constrained``); with their log-probabilities [m] under the model (zeros unless ``rules.logprobs``)."""
    logits = (run_packed_prompts(packed, input_ids, prompt_mask) if packed is not None
              else run_prompt_positions(forward, input_ids, prompt_mask, start, input_ids.shape[1]))
    logits = logits.index_select(0, draw_from)
    first_step = torch.zeros(1, dtype=torch.long, device=input_ids.device)
    uniform = uniform_draws(sampling.seed_keys, draw_keys, first_step)
    allowed = allowed_tokens(allowed, logits.shape[-1]) if rules.constrained else None
    tokens = choose_tokens(logits, rules.sampling, uniform, sampling, rules.per_row, allowed, rules.device_draw)
    logprobs = chosen_logprobs(logits, tokens) if rules.logprobs else torch.zeros_like(tokens, dtype=torch.float32)
    return tokens, logprobs


def hold_slots(state: DecodeState, slots: torch.Tensor) -> None:
    """Make ``slots`` [k] hold no row until rows are inserted there (their cache rows being prefilled in passes, with
    decode steps between): ended, their decode steps writing at the cache's last position, which no row's tokens
    take (a row's last decoded token goes at most to L - 2), and their tokens to the spare column."""
    state.finished.index_fill_(0, slots, True)
    state.write_positions.index_fill_(0, slots, state.attention_mask.shape[1] - 1)
    state.steps.index_fill_(0, slots, state.max_new_tokens)


def insert_rows(state: DecodeState, slots: torch.Tensor, start: RowStart, rules: TokenRules) -> None:
    """Give ``slots`` [k] the new rows of ``start``, whose prompts' keys and values are already at positions
    [0, P) of those rows of the cache: each row attends to its prompt, decodes next at position P, and has
    recorded its first token (it may have finished with it)."""
    first_tokens, prompt_mask = start.first_tokens, start.prompt_mask
    bucket_length = prompt_mask.shape[1]
    state.attention_mask.index_fill_(0, slots, 0)
    state.attention_mask[:, :bucket_length].index_copy_(0, slots, prompt_mask)
    state.write_positions.index_fill_(0, slots, bucket_length)
    state.position_ids.index_copy_(0, slots, prompt_mask.sum(-1, keepdim=True))
    state.input_ids.index_copy_(0, slots, first_tokens.unsqueeze(-1))
    for buffer, values in zip((state.limits, state.adapter_slots, *state.sampling),
                              (start.limits, start.adapter_slots, *start.sampling)):
        buffer.index_copy_(0, slots, values)
    if rules.sampling.do_sample or rules.per_row:  # every step's draw number, made once
        steps = torch.arange(state.uniforms.shape[1], device=slots.device).unsqueeze(0)
        state.uniforms.index_copy_(0, slots, uniform_draws(start.sampling.seed_keys.unsqueeze(-1),
                                                           start.draw_keys.unsqueeze(-1), steps))
    state.new_tokens.index_fill_(0, slots, rules.pad_token_id)
    state.new_tokens[:, 0].index_copy_(0, slots, first_tokens)
    state.logprobs.index_fill_(0, slots, 0)
    state.logprobs[:, 0].index_copy_(0, slots, start.first_logprobs)
    ended = start.limits <= 1
    if rules.stop_at_eos:
        ended |= ends_on(rules, first_tokens)
    state.finished.index_copy_(0, slots, ended)
    state.steps.index_copy_(0, slots, torch.where(ended, state.max_new_tokens, 1))


def decode_one_token(forward: Forward, state: DecodeState, rules: TokenRules, rows_aligned: bool) -> torch.Tensor:
    """The whole decode step, in place on ``state``: every row attends from its token in ``input_ids`` (whose
    keys and values join its row of the cache at ``write_positions``), chooses its next token [B], records
    it, and moves its own positions on by one. Nothing here waits for the host.

    The model is told one cache position for the batch: with ``rows_aligned`` (every row inserted together,
    for a model that builds its masks from that position) the rows' common write position; otherwise the
    last one, and the core's 4D mask alone says what each row sees: nothing for a finished row (its output is never
    read; the mask is additive, so an attention that computes it anyway attends evenly, never to NaN)."""
    cache_length = state.attention_mask.shape[1]
    state.attention_mask.scatter_(1, state.write_positions.unsqueeze(-1), 1)  # each token attends to itself
    if rows_aligned:
        cache_position = state.write_positions[:1]
    else:  # a finished row, or a slot that holds none, sees nothing: an attention that reads only what each row sees
        state.attention_mask.masked_fill_(state.finished.unsqueeze(-1), 0)  # reads nothing for it
        cache_position = torch.full((1,), cache_length - 1, dtype=torch.long, device=state.input_ids.device)
    logits = forward(state.input_ids, state.attention_mask, state.position_ids, cache_position)
    uniform = state.uniforms.gather(1, state.steps.unsqueeze(-1)).squeeze(-1)
    allowed = allowed_tokens(state.allowed, logits.shape[-1]) if rules.constrained else None  # each row's structure
    chosen = choose_tokens(logits, rules.sampling, uniform, state.sampling, rules.per_row, allowed,
                           rules.device_draw)
    next_tokens = record_tokens(state, chosen, rules, chosen_logprobs(logits, chosen) if rules.logprobs else None)
    state.input_ids.copy_(next_tokens.unsqueeze(-1))
    state.position_ids.add_(1)
    state.write_positions.add_(1).clamp_(max=cache_length - 1)  # a finished row writes on in its own row
    return next_tokens


def record_tokens(state: DecodeState, tokens: torch.Tensor, rules: TokenRules,
                  logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """Write ``tokens`` [B] (and their ``logprobs``, when given) at each row's step of ``new_tokens`` (a finished
    row's into the spare column, as padding), mark the rows that end here (end-of-sequence, or their last new
    token: its own limit), advance the steps."""
    last = state.max_new_tokens
    tokens = tokens.masked_fill(state.finished, rules.pad_token_id)
    state.new_tokens.scatter_(1, state.steps.unsqueeze(-1), tokens.unsqueeze(-1))
    if logprobs is not None:
        state.logprobs.scatter_(1, state.steps.unsqueeze(-1), logprobs.unsqueeze(-1))
    ends = state.steps >= state.limits - 1
    if rules.stop_at_eos:
        ends |= ends_on(rules, tokens)
    state.finished.logical_or_(ends)
    state.steps.add_(1).masked_fill_(state.finished, last)
    return tokens
