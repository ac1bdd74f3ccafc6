"""Continuous batching inside one static shape: a finished row's slot takes the next prompt at once.

The decode step keeps one shape (B slots over a cache of L positions per row), captured once and replayed;
the rows inside it change. Every few steps the host reads which rows have finished (the one wait for the
device), collects their tokens, and prefills the next prompts straight into the freed slots' rows of the
cache, in a bucketed static shape (a few row counts times the prompt buckets), while the other rows carry
on. Each row's text is what a fixed batch would give it: its attention sees its own row only, its sampling
draws depend on (seed, prompt number, step) alone.

Prompts are read as slots free up, never further ahead (for a data-parallel replica, reading a prompt is
taking a row from the others). Results come out in the order the prompts came in: a row that finishes early
waits in memory for the rows before it. A prompt is inserted only while it is fewer than ``READ_AHEAD_SLOTS``
times B rows ahead of the oldest row not yet given out, which bounds the rows held: a slot stays free rather
than run further ahead.

The cache holds the largest prompt bucket met so far plus ``max_new_tokens`` positions per row. A prompt
that needs a larger bucket waits until the rows in flight have finished; the cache and the step are then
made anew for it (at most once per bucket).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Callable, Iterable, Iterator

import torch

from accelgen.common.errors import UsageError
from accelgen.common.prompts import PromptError
from accelgen.generation import decoding, slot_decoding
from accelgen.generation.kv_cache import RowWrites, new_static_cache, write_rows_separately

#: Slot steps between two looks at which rows have finished (each look waits for the device); a finished
#: row's slot idles until the next look.
SLOT_CHECK_INTERVAL = 4
#: How many rows ahead of the oldest unfinished row a prompt may start, in multiples of the slot count.
READ_AHEAD_SLOTS = 4


@dataclasses.dataclass
class SlotBatch:
    """The slot step's static shape: B slots of ``cache_length`` positions, their buffers and cache."""

    bucket_capacity: int  # the largest prompt bucket its rows can hold
    cache: object
    rows: RowWrites
    state: slot_decoding.SlotState
    forward: decoding.Forward  # the model called on this cache
    step: Callable[..., object]  # step(*state): captured, or plain
    prefill_shapes: dict[tuple[int, int], "PrefillShape"] = dataclasses.field(default_factory=dict)


class PrefillShape:
    """The fixed-address buffers of one prefill shape (k rows, a bucket of P tokens), and its step. Iterating
    gives the buffers in the order the step takes them."""

    def __init__(self, input_ids: torch.Tensor, state: decoding.DecodeState, slots: torch.Tensor, first_tokens: torch.Tensor):
        self.input_ids = input_ids  # [k, P] left-padded prompts
        self.state = state  # its attention mask [k, P] holds the prompt mask; row_indices [k] the prompt numbers
        self.slots = slots  # [k] the cache rows the prompts go to
        self.first_tokens = first_tokens  # [k] each prompt's first new token
        self.step: Callable[..., object] | None = None

    @classmethod
    def allocate(cls, rows: int, bucket_length: int, device: torch.device) -> "PrefillShape":
        longs = dict(dtype=torch.long, device=device)
        return cls(torch.zeros((rows, bucket_length), **longs), decoding.DecodeState.allocate(rows, bucket_length, 1, device),
                   torch.zeros(rows, **longs), torch.zeros(rows, **longs))

    def __iter__(self):
        state = self.state
        return iter((self.input_ids, state.attention_mask, state.position_ids, state.cache_position, state.step,
                     state.new_tokens, state.finished, state.row_indices, self.slots, self.first_tokens))


@dataclasses.dataclass
class SlotStats:
    """What the slots did in one run: decode steps taken, rows of prefill shapes run (padding rows included),
    and the device-synchronised time of each phase."""

    decode_steps: int = 0
    prefills: int = 0
    prefill_rows: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0


class ContinuousBatcher:
    """Runs prompts through B slots of one static shape. The caller gives it what a generator has: the
    model called on a cache (``forward``), the token rules, how to make a cache storage and how to capture
    a step."""

    def __init__(self, *, slots: int, max_new_tokens: int, buckets: tuple[int, ...], context_limit: int | None,
                 pad_token_id: int, device: torch.device, rules: decoding.TokenRules, model, dtype: torch.dtype,
                 forward: Callable, make_storage: Callable, capture: Callable, capture_prefill: Callable,
                 mark_step: Callable[[], None], synchronize: Callable[[], None]):
        self.slots, self.max_new_tokens, self.buckets = slots, max_new_tokens, tuple(sorted(buckets))
        self.context_limit, self.pad_token_id, self.device, self.rules = context_limit, pad_token_id, device, rules
        self.model, self.dtype, self.forward = model, dtype, forward
        self.make_storage, self.capture, self.capture_prefill = make_storage, capture, capture_prefill
        self.mark_step, self.synchronize = mark_step, synchronize
        self.batch: SlotBatch | None = None
        self.stats = SlotStats()

    def run(self, prompts: Iterable[tuple[int, list[int]]]) -> Iterator[list[tuple[int, list[int]]]]:
        """For (prompt number, token ids), yield (prompt number, new token ids) in the order given, a list at a
        time (the rows that became ready at one look at the slots). The numbers (which key each row's sampling
        draws) need not follow each other. ``stats`` start afresh."""
        self.stats = SlotStats()
        incoming = enumerate(prompts)  # rows are kept apart and ordered by their place in ``prompts``
        waiting: collections.deque[tuple[int, int, list[int], int]] = collections.deque()  # (place, number, ids, bucket)
        in_slot: list[tuple[int, int] | None] = [None] * self.slots  # the (place, number) of the row each slot holds
        steps_left = [0] * self.slots  # decode steps each slot's row may still take (its token budget)
        done: dict[int, tuple[int, list[int]]] = {}  # by place: number, new token ids
        next_out: int | None = None  # the place of the next row to give out
        read_ahead = READ_AHEAD_SLOTS * self.slots
        source_error: Exception | None = None  # raised once the rows read before it are given out
        while True:
            try:
                # read only what the free slots can start (a data-parallel replica takes a row by reading it)
                free = sum(held is None for held in in_slot)
                for place, (number, ids) in itertools.islice(incoming, max(0, free - len(waiting))):
                    waiting.append((place, number, ids, self._bucket_for(number, len(ids))))
                    next_out = place if next_out is None else next_out
            except Exception as error:  # noqa: BLE001 - a prompt that cannot be read or used: finish the ones before
                source_error, incoming = error, iter(())
            if next_out is None:
                if source_error is not None:
                    raise source_error
                return  # no prompts at all
            self.synchronize()
            started = time.perf_counter()
            for slot in self._insert(waiting, in_slot, limit=next_out + read_ahead):
                steps_left[slot] = self.max_new_tokens - 1
            self.synchronize()
            self.stats.prefill_seconds += time.perf_counter() - started
            if all(held is None for held in in_slot):
                if not waiting:
                    if source_error is not None:
                        raise source_error
                    return
                self.batch = None  # the next prompt needs a larger bucket: the slots are empty, make them anew
                continue
            started = time.perf_counter()
            # no more steps than the longest budget left: rows that end by length end together with the steps
            steps = min(SLOT_CHECK_INTERVAL, max(steps_left[slot] for slot, held in enumerate(in_slot) if held is not None))
            for _ in range(steps):
                self.batch.step(*self.batch.state)
                self.mark_step()
            steps_left = [max(0, left - steps) for left in steps_left]
            self.stats.decode_steps += steps
            self._collect(in_slot, done)  # reads the device: the steps have run
            self.stats.decode_seconds += time.perf_counter() - started
            ready = []
            while next_out in done:
                ready.append(done.pop(next_out))
                next_out += 1
            if ready:
                yield ready

    # -- the steps ----------------------------------------------------------------------------------

    def _bucket_for(self, number: int, length: int) -> int:
        try:
            return decoding.choose_bucket(length, self.buckets, self.context_limit, self.max_new_tokens)
        except UsageError as error:
            raise PromptError(number, f": {error}") from None

    def _insert(self, waiting: collections.deque, in_slot: list, limit: int) -> list[int]:
        """Prefill the waiting prompts that fit into the free slots, in one bucketed shape; the slots filled."""
        free = [slot for slot, held in enumerate(in_slot) if held is None]
        group = []
        while waiting and len(group) < len(free) and waiting[0][0] < limit:
            if self.batch is None:
                self.batch = self._new_batch(max(bucket for *_, bucket in list(waiting)[: self.slots]))
            if waiting[0][3] > self.batch.bucket_capacity:
                break  # wait for the slots to empty, then grow
            group.append(waiting.popleft())
        if not group:
            return []
        slots = free[: len(group)]
        for slot, (place, number, _, _) in zip(slots, group):
            in_slot[slot] = (place, number)
        self._prefill(slots, [(number, ids, bucket) for _, number, ids, bucket in group])
        return slots

    def _prefill(self, slots: list[int], group: list[tuple[int, list[int], int]]) -> None:
        """Run ``group``'s prompts through the model in one bucketed shape (its step captured the first time the
        shape is met, as the slot step is), their keys and values written into the rows ``slots`` of the cache,
        and insert them (the first token chosen)."""
        batch = self.batch
        rows = _prefill_rows(len(group), self.slots)
        bucket_length = max(bucket for _, _, bucket in group)
        shape = batch.prefill_shapes.get((rows, bucket_length))
        fresh = shape is None
        if fresh:
            shape = batch.prefill_shapes[rows, bucket_length] = PrefillShape.allocate(rows, bucket_length, self.device)
        input_ids, prompt_mask = decoding.left_pad([ids for _, ids, _ in group], bucket_length, rows, self.pad_token_id)
        shape.input_ids.copy_(input_ids)
        shape.state.attention_mask.copy_(prompt_mask)
        # padding rows repeat the first prompt into the first slot: the same values, written twice
        shape.slots.copy_(torch.tensor(slots + [slots[0]] * (rows - len(slots))))
        shape.state.row_indices.copy_(torch.tensor([number for number, _, _ in group] + [group[0][0]] * (rows - len(group))))
        if fresh:
            shape.step = self.capture_prefill(self._prefill_step(shape), tuple(shape))  # a run writes what a replay does
        shape.step(*shape)
        count = len(group)
        slot_decoding.insert_rows(batch.state, shape.slots[:count], shape.first_tokens[:count],
                                  shape.state.attention_mask[:count], shape.state.row_indices[:count], self.rules)
        self.mark_step()
        self.stats.prefills += 1
        self.stats.prefill_rows += rows

    def _prefill_step(self, shape: "PrefillShape") -> Callable[..., torch.Tensor]:
        """The prefill of one shape as a step over its buffers: the prompts' keys and values into the rows named
        by ``shape.slots``, each row's first token into ``shape.first_tokens``."""
        batch, rules = self.batch, self.rules

        def prefill_step(input_ids, attention_mask, position_ids, cache_position, step, new_tokens, finished,
                         row_indices, slots, first_tokens):
            state = decoding.DecodeState(input_ids[:, -1:], position_ids, cache_position, attention_mask, step,
                                         new_tokens, finished, row_indices)
            batch.rows.prompt_slots = slots
            try:
                first_tokens.copy_(decoding.prefill(batch.forward, state, input_ids, attention_mask, rules))
            finally:
                batch.rows.prompt_slots = None
            return first_tokens

        return prefill_step

    def _collect(self, in_slot: list, done: dict) -> None:
        """Take the tokens of every row that has finished, and free its slot."""
        state = self.batch.state
        finished = state.finished.tolist()
        ended = [slot for slot, held in enumerate(in_slot) if held is not None and finished[slot]]
        if not ended:
            return
        tokens = state.new_tokens[ended, : self.max_new_tokens].tolist()
        for slot, row_tokens in zip(ended, tokens):
            place, number = in_slot[slot]
            done[place] = (number, row_tokens)
            in_slot[slot] = None

    def _new_batch(self, bucket_capacity: int) -> SlotBatch:
        """The slot step's cache, buffers and step for rows of prompts up to ``bucket_capacity`` tokens."""
        self.batch = None  # the old cache's memory goes first
        cache_length = bucket_capacity + self.max_new_tokens
        storage = self.make_storage(self.slots, cache_length)
        cache = new_static_cache(self.model, cache_length, self.dtype, self.device, storage)
        self.mark_step()
        state = slot_decoding.SlotState.allocate(self.slots, cache_length, self.max_new_tokens, self.device)
        rows = write_rows_separately(cache, state.write_positions)
        forward = _on_cache(self.forward, cache)
        rules = self.rules

        def slot_step(*buffers: torch.Tensor) -> torch.Tensor:
            return slot_decoding.decode_one_slot_token(forward, slot_decoding.SlotState(*buffers), rules)

        if not all(getattr(layer, "is_initialized", True) for layer in cache.layers):
            _give_memory(forward, rows, self.pad_token_id, self.device)
            self.mark_step()
        batch = SlotBatch(bucket_capacity, cache, rows, state, forward, slot_step)
        batch.step = self.capture(slot_step, tuple(state))  # before any row is in it: a warm-up run harms nothing
        return batch


def _give_memory(forward: Callable, rows: RowWrites, pad_token_id: int, device: torch.device) -> None:
    """Run one padding token into slot 0 (which holds no row), so that a cache whose layers take memory on
    first use (transformers >= 4.56) has it before the slot step is captured: a capture cannot allocate."""
    one = torch.ones((1, 1), dtype=torch.long, device=device)
    rows.prompt_slots = torch.zeros(1, dtype=torch.long, device=device)
    try:
        forward(one * pad_token_id, one, one * 0, torch.zeros(1, dtype=torch.long, device=device))
    finally:
        rows.prompt_slots = None


def _prefill_rows(prompts: int, slots: int) -> int:
    """The row count of the prefill shape for ``prompts`` prompts: the next power of two, at most ``slots``."""
    rows = 1
    while rows < prompts:
        rows *= 2
    return min(rows, slots)


def _on_cache(forward: Callable, cache) -> Callable:
    def on_cache(input_ids, attention_mask, position_ids, cache_position):
        return forward(input_ids, attention_mask, position_ids, cache_position, cache=cache)

    return on_cache
