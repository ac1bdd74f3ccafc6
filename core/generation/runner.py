"""The runner: the device side of the engine, which carries out the scheduler's plans.

It owns the KV cache's memory (one :class:`~accelgen.model.transformers_adapter.static_cache.CacheStorage`,
checked against the device's free memory before it grows), and for each cache length the slots are made
for (a prompt bucket plus the new tokens) a :class:`SlotShape`: the cache, the decode step's buffers
(:class:`~accelgen.generation.decoding.DecodeState`) and the decode step, captured by the accelerator
before any row is in it, and one prefill step per prefill shape (k rows of a P-token bucket), captured the
first time it is met (where prefills are not captured and the model allows, prompts with nothing found stored
run instead packed one after another in one row, none padded). Each row's LoRA adapter is a buffer slot its steps
read (``DecodeState.adapter_slots``; a prefill's, per prompt), the adapters an insertion needs copied in before it.
A later run of the same shapes replays what was captured. It never calls back up: what it needs (the model called
on a cache, the accelerator, the settings) it is given when made.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from typing import Callable, Iterator

import torch

from accelgen.common.errors import GraphCaptureWarning, first_line, interruption_in
from accelgen.common.settings import RunSettings, World
from accelgen.generation import decoding
from accelgen.generation.constraints import SlotConstraints
from accelgen.generation.prefix_reuse import PrefixReuse, store_bytes
from accelgen.generation.sampling import RowSampling, seed_key
from accelgen.generation.scheduler import Insertion, Row
from accelgen.generation.stats import GenerationStats
from accelgen.model.memory import check_cache_fits
from accelgen.model.transformers_adapter.forward import ModelForward
from accelgen.model.transformers_adapter.static_cache import (
    CacheStorage,
    copy_prompt_rows,
    needs_first_write,
    new_static_cache,
    packed_rows,
    prompt_rows,
    write_each_row_at,
)
from accelgen.parallel.process_groups import gather_from_ranks
from accelgen.plugin.contract import Accelerator

#: The most prompt tokens a prefill packs in one row: its mask holds the square of their count.
PACKED_MOST_TOKENS = 2048


class PrefillShape:
    """The fixed-address buffers of one prefill shape (k prompts of a bucket of P tokens, m rows started from
    them: one per prompt, or one per sample), and its step. Iterating gives the buffers in the order the step
    takes them."""

    def __init__(self, rows: int, bucket_length: int, draws: int, start: int, device: torch.device, mask_words: int = 0):
        self.first_position = start  # the first position its step runs (those before are in the cache rows: stored, or chunks)
        longs = decoding.long_zeros(device)
        self.input_ids = longs(rows, bucket_length)  # [k, P] left-padded prompts
        self.prompt_mask = longs(rows, bucket_length)  # [k, P] 1 = real token
        self.slots = longs(rows)  # [k] the cache rows the prompts go to
        self.draw_from = longs(draws)  # [m] the prompt each started row comes from
        self.draw_keys = longs(draws)  # [m] each started row's draw key (``Row.draw_key``)
        self.draw_slots = longs(draws)  # [m] each started row's slot
        self.first_tokens = longs(draws)  # [m] each started row's first new token
        floats = lambda *shape: torch.zeros(shape, dtype=torch.float32, device=device)  # noqa: E731
        self.first_logprobs = floats(draws)  # [m] its log-probability
        self.limits = longs(draws)  # [m] each started row's maximum of new tokens
        self.sampling = RowSampling(floats(draws), floats(draws), longs(draws))  # [m] each started row's sampling
        self.adapter_slots = longs(rows)  # [k] the buffer slot of each prompt's LoRA adapter (0: the base model's)
        self.allowed = torch.full((draws, mask_words), -1, dtype=torch.int32, device=device)  # [m, W] its first token's mask
        self.step: Callable[..., object] | None = None
        self.packed_step: Callable[..., object] | None = None  # the step with its prompts packed in one row
        #: the steps of the chunks before ``first_position``, by span [start, end) of positions, over ``passes_over``
        self.chunk_steps: dict[tuple[int, int], Callable[..., object]] = {}

    @property
    def passes_over(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The buffers a chunk's step takes: the prompts, their mask and their slots."""
        return self.input_ids, self.prompt_mask, self.slots

    def __iter__(self):
        return iter((self.input_ids, self.prompt_mask, self.slots, self.draw_from, self.draw_keys, self.draw_slots,
                     self.first_tokens, self.first_logprobs, self.allowed, *self.sampling))

    def start(self, rows: int) -> decoding.RowStart:
        """What starting the first ``rows`` draws in their slots takes (after the step has run)."""
        prompts = self.draw_from[:rows]
        return decoding.RowStart(self.first_tokens[:rows], self.first_logprobs[:rows],
                                 self.prompt_mask.index_select(0, prompts), self.draw_keys[:rows],
                                 self.limits[:rows], RowSampling(*(values[:rows] for values in self.sampling)),
                                 self.adapter_slots.index_select(0, prompts))


class SlotShape:
    """Everything the slots need for one cache length, kept while the storage it views lives."""

    def __init__(self, cache, state: decoding.DecodeState, forward: decoding.Forward):
        self.cache = cache  # [B, heads, L, head_dim] per layer
        self.state = state
        self.forward = forward  # the model on this cache
        self.decode_step: Callable[..., object] | None = None  # decode_step(*state): captured, or plain
        self.prefill_shapes: dict[tuple[int, int], PrefillShape] = {}


class SlotRunner:
    """Runs plans for ``run.batch_size`` slots of ``model_forward``'s model on ``accelerator``; ``constraints`` hold
    the slots' rows to their structures (None: the run has none, and its steps take no mask)."""

    def __init__(self, model_forward: ModelForward, accelerator: Accelerator, device: torch.device, run: RunSettings,
                 world: World, rules: decoding.TokenRules, stats: GenerationStats,
                 constraints: SlotConstraints | None = None):
        self.forward, self.accelerator, self.device = model_forward, accelerator, device
        self.run, self.world, self.rules, self.stats = run, world, rules, stats
        self.constraints = constraints
        self.mask_words = 0 if constraints is None else constraints.mask.shape[1]
        self.model = model_forward.model
        self.adapters = model_forward.adapters  # the LoRA adapters' buffers, where rows choose adapters
        #: a model that sizes its own masks from the cache position needs every row at one position
        self.rows_aligned = not model_forward.builds_4d_mask
        #: whether prefills without a stored beginning may run their prompts packed in one row, without padding
        self.packs_prompts = accelerator.tuning.packs_prompts and model_forward.packs_prompts
        self.capture_failure: str | None = None  # why the accelerator could not capture (then steps run eagerly)
        self._storage: CacheStorage | None = None
        self._shapes: dict[int, SlotShape] = {}  # by cache length
        self.shape: SlotShape | None = None  # the one in use
        self._decode_started = 0.0  # when the decode steps up to the next look began
        self._last_step_at: float | None = None  # when the last decode step that rows wait on was issued
        self._positions_waited = 0  # prompt positions prefilled since then
        self._steps_left = self._passes_run = 0  # of the insertion going in: decode steps it may give, passes run
        #: the store of prompt prefixes (--prefix-cache); none for a model whose masks need rows at one position.
        #: The ranks of a replica agree on its size (the smallest of theirs): they must find the same prefixes.
        self.prefixes = None if run.prefix_cache == 0 or self.rows_aligned else PrefixReuse(
            min(gather_from_ranks(store_bytes(run.prefix_cache, accelerator.memory_stats().get("free_bytes")), world)),
            device, stats)
        stats.prefix_store_bytes = None if self.prefixes is None else self.prefixes.budget_bytes

    @property
    def cache_length_in_use(self) -> int | None:
        """Positions per row of the KV cache memory held (its largest cache), None before any."""
        return self._storage.capacity if self._storage else None

    # -- the plan's parts, in order -----------------------------------------------------------------

    def use_bucket(self, bucket: int) -> None:
        """Slots for prompts of up to ``bucket`` tokens (only called while no slot holds a row)."""
        cache_length = bucket + self.run.max_new_tokens
        if self.shape is not None and self.shape.state.attention_mask.shape[1] == cache_length:
            return
        self._make_room_for(cache_length)
        if cache_length not in self._shapes:
            self._shapes[cache_length] = self._new_shape(cache_length)
        self.shape = self._shapes[cache_length]

    def insert(self, insertion: Insertion) -> int:
        """Start the insertion's rows: parked samples from their prompt's cache row (first, before a prefill here
        may reuse that row), the others prefilled (their keys and values into their slots' rows of the cache, first
        tokens chosen) in shapes bucketed by their own prompts' lengths, each step captured the first time it is met.
        Prompts that share a beginning not yet stored are prefilled in two parts: the first of each beginning, then
        the others, which find it stored. A prompt longer than ``--prefill-chunk`` is prefilled in passes. Between two
        passes the rows already running take a decode step, ``insertion.decode_between`` at most (so none waits
        longer than one pass): returns how many they took. Rows started by an earlier part take them too."""
        if not insertion.decode_between:  # no row waits for this insertion
            self._last_step_at = None
        self._steps_left, self._passes_run = insertion.decode_between, 0
        decode_before = self.stats.decode_seconds
        with self._timed("prefill_seconds"):
            for adapter, slot in insertion.adapter_loads:
                self.adapters.load_into(adapter, slot)
            self.stats.adapter_loads += len(insertion.adapter_loads)
            if insertion.resumed:
                self._start_parked(insertion.resumed)
            for part in self._parts(insertion):
                self._prefill(part)
            self.accelerator.mark_step()
        self.stats.prefill_seconds -= self.stats.decode_seconds - decode_before  # the steps between passes: decode
        return insertion.decode_between - self._steps_left

    def _parts(self, insertion: Insertion) -> list[Insertion]:
        """The prefills of the insertion's prompts, in order: one per bucket among them where prefills are captured
        (a shape per bucket: a short prompt computes no longer bucket's positions), else one for all, every prompt at
        the largest bucket (an eager pass computes the positions of its longest prompt whatever the bucket, and
        costs more for being a pass than for a short prompt's padding; the same where the model needs rows at one
        position); each split for prefix reuse in two when some prompts share a beginning not stored yet."""
        if not insertion.prefilled:
            return []
        one_bucket = self.rows_aligned or not self.accelerator.tuning.captures_prefill
        buckets = [insertion.bucket_length] if one_bucket else sorted({row.bucket for row in insertion.prefilled})
        parts = [insertion] if len(buckets) == 1 else [
            insertion.of_prompts({row.number for row in insertion.prefilled if row.bucket == bucket}) for bucket in buckets]
        if self.prefixes is None:
            return parts
        return [part.of_prompts(numbers) for part in parts for numbers in self.prefixes.leaders_then_followers(part.prefilled)]

    def _prefill(self, insertion: Insertion) -> None:
        """Prefill the insertion's prompts and draw its first tokens: its new rows start; the samples parked now
        keep their first tokens (read back) and the slot of their prompt's cache row. In passes of at most
        ``--prefill-chunk`` positions."""
        shape = self.shape
        draws, prompts = insertion.draws, insertion.prefilled
        slot_of = {id(row): slot for row, slot in zip(insertion.rows, insertion.slots)}
        started = sum(id(row) in slot_of for row in draws)  # the draws that start now come first; then the parked
        # each prompt goes to the slot of its first row; padding rows repeat the first: the same values, written twice
        prompt_slots = [slot_of[id(draws[insertion.sources.index(place)])] for place in range(len(prompts))]
        window = insertion.bucket_length if self.prefixes is None else self.prefixes.reuse(
            shape.cache, prompts, prompt_slots, insertion.bucket_length)
        found_stored = window < insertion.bucket_length
        longest = max(len(row.prompt_ids) for row in prompts)
        if not self.accelerator.tuning.captures_prefill:  # an eager prefill skips the padding before its longest prompt
            window = min(window, decoding.padded_length(longest))
        spans = decoding.prefill_spans(insertion.bucket_length, window, longest, self.run.prefill_chunk)
        prompt_tokens = sum(len(row.prompt_ids) for row in prompts)
        # packed in one row: every prompt computed whole (nothing found stored), in one pass, whose mask stays small,
        # never captured (a captured step keeps one shape)
        packed = (self.packs_prompts and not found_stored and len(spans) == 1 and prompt_tokens <= PACKED_MOST_TOKENS
                  and not (self.run.use_graphs and self.accelerator.tuning.captures_prefill))
        # a captured prefill takes one of a few row counts (powers of two, padding rows repeating the first); an eager
        # one takes the prompts and draws as they come, and computes no padding row
        rows, draw_rows = ((insertion.shape_rows, insertion.draw_rows) if self.accelerator.tuning.captures_prefill
                           else (len(prompts), len(draws)))
        self.stats.prompt_tokens += prompt_tokens
        self.stats.prefilled_tokens += sum(min(len(row.prompt_ids), insertion.bucket_length - spans[0][0]) for row in prompts)
        self.stats.prefill_positions += prompt_tokens if packed else rows * (spans[-1][1] - spans[0][0])
        key = (rows, insertion.bucket_length, draw_rows, spans[-1][0])
        prefill_shape = shape.prefill_shapes.get(key)
        fresh = prefill_shape is None
        if fresh:
            prefill_shape = shape.prefill_shapes[key] = PrefillShape(*key, self.device, self.mask_words)
        input_ids, prompt_mask = decoding.left_pad([row.prompt_ids for row in prompts], insertion.bucket_length,
                                                   rows, self.rules.pad_token_id)
        prefill_shape.input_ids.copy_(input_ids)
        prefill_shape.prompt_mask.copy_(prompt_mask)
        draw_slots = [slot_of.get(id(row), prompt_slots[source]) for row, source in zip(draws, insertion.sources)]
        prefill_shape.slots.copy_(torch.tensor(_padded(prompt_slots, rows)))
        prefill_shape.draw_from.copy_(torch.tensor(_padded(insertion.sources, draw_rows)))
        prefill_shape.draw_keys.copy_(torch.tensor(_padded([row.draw_key for row in draws], draw_rows)))
        prefill_shape.draw_slots.copy_(torch.tensor(_padded(draw_slots, draw_rows)))
        prefill_shape.adapter_slots.copy_(torch.tensor(_padded([row.adapter_slot for row in prompts], rows)))
        limits, sampling = _row_settings(draws)
        prefill_shape.limits.copy_(torch.tensor(_padded(limits, draw_rows)))
        for buffer, values in zip(prefill_shape.sampling, sampling):
            buffer.copy_(torch.tensor(_padded(values, draw_rows), dtype=buffer.dtype))
        if self.constraints is not None:  # each draw's first token under its structure
            masks = self.constraints.first_masks(draws, [prompts[source].prompt_ids for source in insertion.sources])
            prefill_shape.allowed.copy_(masks[_padded(list(range(len(draws))), draw_rows)])
        if self._steps_left:  # the decode steps between the passes must not write into the rows being prefilled
            decoding.hold_slots(shape.state, torch.tensor(insertion.slots, device=self.device))
        for span in spans[:-1]:
            if span not in prefill_shape.chunk_steps:
                prefill_shape.chunk_steps[span] = self._captured(
                    self._chunk_step(prefill_shape, *span), prefill_shape.passes_over, "prefill_captures")
            self._prefill_pass(prefill_shape.chunk_steps[span], prefill_shape.passes_over, span)
        if packed:
            if prefill_shape.packed_step is None:
                prefill_shape.packed_step = self._prefill_step(prefill_shape, packed=True)
            self._prefill_pass(prefill_shape.packed_step, tuple(prefill_shape), spans[-1])
        else:
            if prefill_shape.step is None:
                prefill_shape.step = self._captured(self._prefill_step(prefill_shape), tuple(prefill_shape),
                                                    "prefill_captures")
            self._prefill_pass(prefill_shape.step, tuple(prefill_shape), spans[-1])  # a captured step's run writes as a replay
        self.stats.prefills += 1
        self.stats.prefill_rows += rows
        self.stats.slot_tokens += rows
        decoding.insert_rows(shape.state, prefill_shape.draw_slots[:started], prefill_shape.start(started), self.rules)
        if self.constraints is not None and any(row.settings.structure is not None for row in draws[:started]):
            self._start_constraints(draws[:started], draw_slots[:started], prefill_shape.first_tokens[:started].tolist())
        if self.prefixes is not None:
            self.prefixes.store(shape.cache, prompts, prompt_slots, insertion.bucket_length)
        if started < len(draws):  # the parked samples keep what they drew
            tokens = prefill_shape.first_tokens[started: len(draws)].tolist()
            logprobs = prefill_shape.first_logprobs[started: len(draws)].tolist()
            for row, slot, token, logprob in zip(draws[started:], draw_slots[started:], tokens, logprobs):
                row.first_token, row.first_logprob, row.prompt_slot = token, logprob, slot
                row.bucket = insertion.bucket_length  # where its prompt's cache row holds the prompt

    def _prefill_pass(self, step: Callable[..., object], buffers: tuple[torch.Tensor, ...], span: tuple[int, int]) -> None:
        """One forward pass of a prefill, over positions ``span`` of its bucket, timed (the longest is kept); after a
        decode step of the running rows when a pass of this insertion ran before it and they have steps left."""
        if self._passes_run and self._steps_left:
            with self._timed("decode_seconds"):
                self._decode_step()
            self._steps_left -= 1
            if not self._steps_left:  # the running rows have ended: none waits any more
                self._last_step_at = None
        self.accelerator.synchronize()
        started = time.perf_counter()
        step(*buffers)
        self.accelerator.mark_step()
        self.accelerator.synchronize()
        self._passes_run += 1
        self.stats.prefill_passes += 1
        self.stats.longest_prefill_pass = max(self.stats.longest_prefill_pass, time.perf_counter() - started)
        if self._last_step_at is not None:  # rows wait on this pass
            self._positions_waited += span[1] - span[0]

    def _start_parked(self, resumed: list[tuple[Row, int]]) -> None:
        """Start parked samples in their slots: their prompt's keys and values copied from its cache row, their
        first tokens those drawn when it was prefilled."""
        for bucket in sorted({row.bucket for row, _ in resumed}):
            rows = [row for row, _ in resumed if row.bucket == bucket]
            slots = torch.tensor([slot for row, slot in resumed if row.bucket == bucket], device=self.device)
            sources = torch.tensor([row.prompt_slot for row in rows], device=self.device)
            copy_prompt_rows(self.shape.cache, sources, slots, bucket)
            on_device = functools.partial(torch.tensor, device=self.device)
            _, prompt_mask = decoding.left_pad([row.prompt_ids for row in rows], bucket, len(rows), self.rules.pad_token_id)
            limits, (temperatures, top_ps, seed_keys) = _row_settings(rows)
            start = decoding.RowStart(
                on_device([row.first_token for row in rows]), on_device([row.first_logprob for row in rows]),
                prompt_mask.to(self.device), on_device([row.draw_key for row in rows]), on_device(limits),
                RowSampling(on_device(temperatures, dtype=torch.float32), on_device(top_ps, dtype=torch.float32),
                            on_device(seed_keys)), on_device([row.adapter_slot for row in rows]))
            decoding.insert_rows(self.shape.state, slots, start, self.rules)
            if self.constraints is not None:
                self._start_constraints(rows, slots.tolist(), [row.first_token for row in rows])

    def _start_constraints(self, rows: list[Row], slots: list[int], first_tokens: list[int]) -> None:
        """The rows just started in ``slots`` follow their structures from their ``first_tokens``."""
        started = time.perf_counter()
        for row, slot, token in zip(rows, slots, first_tokens):
            self.constraints.start(slot, row, token)
        self.stats.mask_seconds += time.perf_counter() - started

    def decode(self, steps: int) -> None:
        """Replay the decode step ``steps`` times (timed up to the next look, which reads the device)."""
        self._decode_started = time.perf_counter()
        for _ in range(steps):
            self._decode_step()

    def _decode_step(self) -> None:
        """One decode step of every slot, counted; the wait since the one before is kept when it is the longest. With
        rows held to a structure, the host follows their tokens: the mask the step reads is brought up to date before
        it, and the tokens it chose are read back after it."""
        constraints = self.constraints
        if constraints is not None and constraints.changed:
            self.shape.state.allowed.copy_(constraints.mask)
            constraints.changed = False
        self.shape.decode_step(*self.shape.state)
        self.accelerator.mark_step()
        if constraints is not None and constraints.active:
            self._advance_constraints()
        self.stats.decode_steps += 1
        self.stats.slot_tokens += self.run.batch_size
        now = time.perf_counter()
        if self._last_step_at is not None:
            self.stats.longest_decode_gap = max(self.stats.longest_decode_gap, now - self._last_step_at)
            self.stats.longest_wait_positions = max(self.stats.longest_wait_positions, self._positions_waited)
        self._last_step_at, self._positions_waited = now, 0

    def _advance_constraints(self) -> None:
        """Read back the tokens the last decode step chose and whether each row has ended, and advance the rows'
        grammars by them (the host's work timed apart from the wait for the step)."""
        state = self.shape.state
        tokens, finished = torch.stack((state.input_ids[:, 0], state.finished.long())).tolist()
        started = time.perf_counter()
        self.constraints.advance(tokens, finished)
        self.stats.mask_seconds += time.perf_counter() - started

    def finished_slots(self) -> list[bool]:
        """Which slots' rows have ended: the one wait for the device between two plans."""
        finished = self.shape.state.finished.tolist()
        self.stats.decode_seconds += time.perf_counter() - self._decode_started
        return finished

    def new_tokens(self, slots: list[int]) -> list[list[int]]:
        """The new tokens of ``slots``' rows (padding after each row's end)."""
        return self.shape.state.new_tokens[slots, : self.run.max_new_tokens].tolist()

    def read_back(self, slots: list[int]) -> tuple[dict[int, list[int]], dict[int, list[float]] | None]:
        """The new tokens of ``slots``' rows by slot, and their log-probabilities when they are recorded
        (``--logprobs``); nothing is read from the device for no slot."""
        if not slots:
            return {}, None
        if self.constraints is not None:
            for slot in slots:
                self.constraints.release(slot)
        logprobs = self.shape.state.logprobs[slots, : self.run.max_new_tokens].tolist() if self.rules.logprobs else None
        return dict(zip(slots, self.new_tokens(slots))), None if logprobs is None else dict(zip(slots, logprobs))

    # -- shapes -------------------------------------------------------------------------------------

    def _new_shape(self, cache_length: int) -> SlotShape:
        """The cache, buffers and forward of slots with ``cache_length`` positions per row."""
        cache = new_static_cache(self.model, cache_length, self.run.torch_dtype, self.device, self._storage)
        self.accelerator.mark_step()  # on transformers 4.55 that ran a forward pass (its shape probe)
        state = decoding.DecodeState.allocate(self.run.batch_size, cache_length, self.run.max_new_tokens, self.device,
                                              self.mask_words)
        if self.constraints is not None:  # the new buffers allow every token: the host's mask goes in before a step
            self.constraints.changed = True
        write_each_row_at(cache, state.write_positions)
        # rows that see nothing (finished, or none) run on zeros where the kernels skip them; a model whose masks need
        # rows at one position sees its rows' masks unchanged
        zero_unseen_rows = self.accelerator.tuning.skips_zero_rows and not self.rows_aligned
        shape = SlotShape(cache, state, functools.partial(self.forward, cache=cache, zero_unseen_rows=zero_unseen_rows))
        if needs_first_write(cache):  # one padding token into slot 0, which holds no row: a capture cannot allocate
            one = torch.ones((1, 1), dtype=torch.long, device=self.device)
            first = torch.zeros(1, dtype=torch.long, device=self.device)
            self._forward_into_rows(cache, cache_length, first)(one * self.rules.pad_token_id, one, one * 0, first)
            self.accelerator.mark_step()
        self._make_decode_step(shape)
        return shape

    def _make_decode_step(self, shape: SlotShape) -> None:
        """The shape's decode step, captured before any row is in it (a warm-up run harms nothing then), or
        plain; none when no row takes a decode step."""
        if self.run.max_new_tokens <= 1:
            return
        forward, rules, rows_aligned = shape.forward, self.rules, self.rows_aligned

        def decode_step(*buffers: torch.Tensor) -> torch.Tensor:
            state = decoding.DecodeState(*buffers)
            on_rows_adapters = functools.partial(forward, adapter_slots=state.adapter_slots)
            return decoding.decode_one_token(on_rows_adapters, state, rules, rows_aligned)

        shape.decode_step = self._captured(decode_step, tuple(shape.state), "graph_captures")

    def _prefill_step(self, prefill_shape: PrefillShape, packed: bool = False) -> Callable[..., torch.Tensor]:
        """The prefill of one shape as a step over its buffers: the prompts' keys and values into the cache rows
        named by its ``slots``, each prompt's first token into its ``first_tokens``; ``packed``: the prompts whole,
        packed in one row (``decoding.run_packed_prompts``)."""
        rules, cache, start = self.rules, self.shape.cache, prefill_shape.first_position
        adapter_slots = prefill_shape.adapter_slots
        forward = self._forward_into_rows(cache, self.shape.state.attention_mask.shape[1], prefill_shape.slots, start,
                                          adapter_slots)

        shares_prompts = self.run.num_samples > 1 or self.run.rows_choose  # a row may ask for several samples

        def prefill_step(input_ids, prompt_mask, slots, draw_from, draw_keys, draw_slots, first_tokens, first_logprobs,
                         allowed, *sampling):
            into_rows = functools.partial(self._packed_forward, cache, slots, adapter_slots) if packed else None
            tokens, logprobs = decoding.prefill(forward, input_ids, prompt_mask, draw_from, draw_keys,
                                                RowSampling(*sampling), rules, start, into_rows, allowed)
            if shares_prompts:  # each sample's row of the cache gets its prompt's keys and values
                copy_prompt_rows(cache, slots.index_select(0, draw_from), draw_slots, input_ids.shape[1])
            first_logprobs.copy_(logprobs)
            return first_tokens.copy_(tokens)

        return prefill_step

    def _chunk_step(self, prefill_shape: PrefillShape, start: int, end: int) -> Callable[..., torch.Tensor]:
        """The pass of positions [start, end) of a prefill shape's prompts (a chunk before its last) as a step over
        ``passes_over``: their keys and values into the cache rows named by its ``slots``."""
        forward = self._forward_into_rows(self.shape.cache, self.shape.state.attention_mask.shape[1], prefill_shape.slots,
                                          start, prefill_shape.adapter_slots)

        def chunk_step(input_ids, prompt_mask, slots):
            return decoding.run_prompt_positions(forward, input_ids, prompt_mask, start, end)

        return chunk_step

    def _packed_forward(self, cache, slots: torch.Tensor, adapter_slots: torch.Tensor, input_ids: torch.Tensor,
                        prompt_of: torch.Tensor, position_ids: torch.Tensor, ends: torch.Tensor,
                        token_positions: torch.Tensor) -> torch.Tensor:
        """The model on prompts packed in one row (``decoding.PackedForward``), prompt i's keys and values into row
        ``slots[i]`` of ``cache``, computed with the adapter in buffer slot ``adapter_slots[i]``."""
        view = packed_rows(cache, slots.index_select(0, prompt_of), token_positions)
        return self.forward.packed_logits(input_ids, prompt_of, position_ids, ends, view, adapter_slots)

    def _forward_into_rows(self, cache, cache_length: int, slots: torch.Tensor, start: int = 0,
                           adapter_slots: torch.Tensor | None = None) -> decoding.Forward:
        """The model called on prompts whose keys and values go into the rows ``slots`` [k] of ``cache`` (from
        position ``start`` on, attending to what the rows hold before it), each computed with the adapter in its buffer
        slot of ``adapter_slots`` [k] (None: the base model)."""
        on_view = functools.partial(self.forward, cache=prompt_rows(cache, slots, self.rows_aligned, start),
                                    adapter_slots=adapter_slots)
        if not self.rows_aligned:
            return on_view

        def forward(input_ids, prompt_mask, position_ids, cache_position):
            # the model attends over whole cache rows, with a mask sized to match
            mask = torch.nn.functional.pad(prompt_mask, (0, cache_length - prompt_mask.shape[1]))
            return on_view(input_ids, mask, position_ids, cache_position)

        return forward

    def _captured(self, step: Callable[..., torch.Tensor], buffers: tuple[torch.Tensor, ...], counter: str) -> Callable:
        """``step`` captured by the accelerator over ``buffers`` when graphs are on and capture works, else ``step``
        itself. Any failure to capture other than running out of memory leaves steps eager, with one warning:
        the eager step runs the very same code, so a real bug in it still surfaces there, as itself. A Ctrl-C or a
        stop signal that the compiler wrapped in its own error goes on as itself."""
        if not self.run.use_graphs or self.capture_failure is not None:
            return step
        if counter == "prefill_captures" and not self.accelerator.tuning.captures_prefill:
            return step
        started = time.perf_counter()
        try:
            captured = self.accelerator.capture(step, buffers, self.run)
        except Exception as error:  # noqa: BLE001 - see the docstring
            if self.accelerator.is_out_of_memory(error):
                raise
            if (interruption := interruption_in(error)) is not None:  # Ctrl-C or a stop, wrapped by the compiler
                raise interruption from None
            self.capture_failure = first_line(error)
            warnings.warn(
                f"the {self.accelerator.name} accelerator cannot capture the decode step of this "
                f"{self.model.config.model_type} model ({self.capture_failure}); running it eagerly: same output, "
                f"slower (pass --no-graphs to skip the attempt)",
                GraphCaptureWarning, stacklevel=2,
            )
            return step
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        self.stats.capture_seconds += time.perf_counter() - started
        return captured

    def _make_room_for(self, cache_length: int) -> None:
        """A cache storage of at least ``cache_length`` positions, checked against the device's free memory. A
        larger one replaces the old, and the shapes whose caches (and graphs) lived in the old one go first."""
        if self._storage is not None and cache_length <= self._storage.capacity:
            return
        self._shapes.clear()
        self.shape = self._storage = None
        check_cache_fits(self.model.config, dtype=self.run.dtype, batch_size=self.run.batch_size, cache_length=cache_length,
                         world_size=self.world.size, device_name=self.accelerator.name,
                         free_bytes=self.accelerator.memory_stats().get("free_bytes"),
                         device_is_host=self.accelerator.shares_host_memory,
                         prefix_store_bytes=0 if self.prefixes is None else self.prefixes.bytes_to_come,
                         prefill_chunk=self.run.prefill_chunk)
        self._storage = CacheStorage(self.run.batch_size, cache_length)

    @contextlib.contextmanager
    def _timed(self, field: str) -> Iterator[None]:
        """Add the block's device-synchronised seconds to ``stats.<field>``."""
        self.accelerator.synchronize()
        started = time.perf_counter()
        yield
        self.accelerator.synchronize()
        setattr(self.stats, field, getattr(self.stats, field) + time.perf_counter() - started)


def _row_settings(rows: list[Row]) -> tuple[list[int], tuple[list[float], list[float], list[int]]]:
    """The rows' maximums of new tokens, and their sampling (temperatures, top-ps, seed keys), as host lists."""
    settings = [row.settings for row in rows]
    return ([own.max_new_tokens for own in settings],
            ([own.temperature for own in settings], [own.top_p for own in settings], [seed_key(own.seed) for own in settings]))


def _padded(values: list[int], length: int) -> list[int]:
    """``values`` made ``length`` long by repeating the first (a padding row writes what the first writes)."""
    return values + values[:1] * (length - len(values))
