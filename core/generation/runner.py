"""The runner: the device side of the engine, which carries out the scheduler's plans.

The slots' shapes (:mod:`accelgen.generation.slot_shapes`: the KV cache's memory and, per cache length, the cache, the
decode step's buffers and the decode step) are made as the plans need them; the runner inserts rows into them, one
prefill step per prefill shape (k rows of a P-token bucket), captured the first time it is met (where prefills are not
captured and the model allows, prompts with nothing found stored run instead packed one after another in one row,
none padded: the prefill shapes and their steps are :mod:`accelgen.generation.prefill_steps`), and runs the decode
step. Each row's LoRA adapter is a buffer slot its steps read (``DecodeState.adapter_slots``; a prefill's, per
prompt), the adapters an insertion needs copied in before it. A later run of the same shapes replays what was
captured. It never calls back up: what it needs (the model called on a cache, the accelerator, the settings) it is
given when made.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Iterator

import torch

from accelgen.common.groups import consecutive_groups
from accelgen.common.settings import RunSettings, World
from accelgen.generation import decoding
from accelgen.generation.constraints import SlotConstraints
from accelgen.generation.prefill_steps import PrefillShape, RowsForward, chunk_step, padded, prefill_step, row_settings
from accelgen.generation.prefix_reuse import PrefixReuse, store_bytes
from accelgen.generation.prompt_scores import PromptScores, ScoredPositions, packed_positions, padded_positions, score_positions
from accelgen.generation.sampling import RowSampling
from accelgen.generation.scheduler import Insertion, Row
from accelgen.generation.slot_shapes import SlotShape, SlotShapes, StepCapture
from accelgen.generation.stats import GenerationStats
from accelgen.model.transformers_adapter.forward import ModelForward
from accelgen.model.transformers_adapter.static_cache import copy_prompt_rows
from accelgen.parallel.process_groups import gather_from_ranks
from accelgen.plugin.contract import Accelerator

#: The most prompt tokens a prefill packs in one row (its mask holds the square of their count); more are prefilled in
#: several packed passes, whose activations stay a few MiB (benchmarks/RESULTS-log.md, "A token budget per prefill pass").
PACKED_MOST_TOKENS = 1024


class SlotRunner:
    """Runs plans for ``run.batch_size`` slots of ``model_forward``'s model on ``accelerator``; ``constraints`` hold
    the slots' rows to their structures (None: the run has none, and its steps take no mask)."""

    def __init__(self, model_forward: ModelForward, accelerator: Accelerator, device: torch.device, run: RunSettings,
                 world: World, rules: decoding.TokenRules, stats: GenerationStats,
                 constraints: SlotConstraints | None = None):
        self.forward, self.accelerator, self.device = model_forward, accelerator, device
        self.run, self.world, self.rules, self.stats = run, world, rules, stats
        self.constraints = constraints
        self.model = model_forward.model
        self.adapters = model_forward.adapters  # the LoRA adapters' buffers, where rows choose adapters
        #: a model that sizes its own masks from the cache position needs every row at one position
        self.rows_aligned = not model_forward.builds_4d_mask
        #: whether prefills without a stored beginning may run their prompts packed in one row, without padding
        self.packs_prompts = accelerator.tuning.packs_prompts and model_forward.packs_prompts
        self.capture = StepCapture(accelerator, run, stats, self.model.config.model_type)
        #: prompts are scored in their prefills (``accelgen.generation.prompt_scores``): those run eagerly, whole
        self.scores_prompts = run.prompt_logprobs is not None
        self._decode_started = 0.0  # when the decode steps up to the next look began
        self._last_step_at: float | None = None  # when the last decode step that rows wait on was issued
        self._positions_waited = 0  # prompt positions prefilled since then
        self._steps_left = self._passes_run = 0  # of the insertion going in: decode steps it may give, passes run
        #: the store of prompt prefixes (--prefix-cache); none for a model whose masks need rows at one position.
        #: The ranks of a replica agree on its size (the smallest of theirs): they must find the same prefixes. A run
        #: that scores its prompts computes every position of each: none is taken from the store.
        self.prefixes = None if run.prefix_cache == 0 or self.rows_aligned or self.scores_prompts else PrefixReuse(
            min(gather_from_ranks(store_bytes(run.prefix_cache, accelerator.memory_stats().get("free_bytes")), world)),
            device, stats)
        stats.prefix_store_bytes = None if self.prefixes is None else self.prefixes.budget_bytes
        self.shapes = SlotShapes(model_forward, accelerator, device, run, world, rules, self.capture, constraints,
                                 self.rows_aligned, self.prefixes)

    @property
    def shape(self) -> SlotShape | None:
        """The slots' shape in use."""
        return self.shapes.current

    @property
    def capture_failure(self) -> str | None:
        """Why the accelerator could not capture (then steps run eagerly), or None."""
        return self.capture.failure

    @property
    def cache_length_in_use(self) -> int | None:
        """Positions per row of the KV cache memory held (its largest cache), None before any."""
        return self.shapes.cache_length_in_use

    # -- the plan's parts, in order -----------------------------------------------------------------

    def use_bucket(self, bucket: int) -> None:
        """Slots for prompts of up to ``bucket`` tokens (only called while no slot holds a row)."""
        self.shapes.use(bucket + self.run.max_new_tokens)

    def capture_now(self) -> None:
        """Capture the decode step from here on (a run that started eagerly, found long enough for it), while rows
        run in the slots (``SlotShapes.capture_now``)."""
        self.shapes.capture_now()

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
        position); each split for prefix reuse in two when some prompts share a beginning not stored yet, and where
        prompts run packed, in parts of at most ``PACKED_MOST_TOKENS`` (``_packed_passes``)."""
        if not insertion.prefilled:
            return []
        one_bucket = self.rows_aligned or not self.accelerator.tuning.captures_prefill
        buckets = [insertion.bucket_length] if one_bucket else sorted({row.bucket for row in insertion.prefilled})
        parts = [insertion] if len(buckets) == 1 else [
            insertion.of_prompts({row.number for row in insertion.prefilled if row.bucket == bucket}) for bucket in buckets]
        if self.prefixes is not None:
            parts = [part.of_prompts(numbers) for part in parts
                     for numbers in self.prefixes.leaders_then_followers(part.prefilled)]
        return [piece for part in parts for piece in self._packed_passes(part)]

    def _packed_passes(self, part: Insertion) -> list[Insertion]:
        """The part in parts of at most ``PACKED_MOST_TOKENS`` prompt tokens each (its prompts in order; a longer
        prompt alone), where its prompts may run packed in one row: each part packed, its pass's activations a few MiB
        where one pass of them all would be tens (its temporaries mapped afresh from the kernel at every operation)."""
        if not self._may_pack():
            return [part]
        groups = consecutive_groups(part.prefilled, lambda row: len(row.prompt_ids), PACKED_MOST_TOKENS)
        return [part] if len(groups) == 1 else [part.of_prompts({row.number for row in group}) for group in groups]

    def _may_pack(self) -> bool:
        """Whether prefills may run their prompts packed in one row now: the model and device allow it, and prefills
        are not captured (a captured step keeps one shape)."""
        return self.packs_prompts and not (self.capture.captures and self.accelerator.tuning.captures_prefill)

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
        # packed in one row: every prompt computed whole (nothing found stored), in one pass, whose mask stays small
        packed = self._may_pack() and not found_stored and len(spans) == 1 and prompt_tokens <= PACKED_MOST_TOKENS
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
            prefill_shape = shape.prefill_shapes[key] = PrefillShape(*key, self.device, self.shapes.mask_words)
        draw_slots = [slot_of.get(id(row), prompt_slots[source]) for row, source in zip(draws, insertion.sources)]
        # a scored prefill runs as it is: its passes' hidden states are read (a captured step would not give them)
        capture = self.capture if not self.scores_prompts else lambda step, buffers, counter: step
        if self.scores_prompts:  # each row's tokens scored, but where a score request says which
            for row in prompts:
                if row.prompt_scores is None:
                    row.prompt_scores = PromptScores.unscored(row.prompt_ids, self.run.prompt_logprobs)
        prefill_shape.load(prompts, prompt_slots, draws, insertion.sources, draw_slots, self.rules.pad_token_id)
        if self.constraints is not None:  # each draw's first token under its structure
            masks = self.constraints.first_masks(draws, [prompts[source].prompt_ids for source in insertion.sources])
            prefill_shape.allowed.copy_(masks[padded(list(range(len(draws))), draw_rows)])
        if self._steps_left:  # the decode steps between the passes must not write into the rows being prefilled
            decoding.hold_slots(shape.state, torch.tensor(insertion.slots, device=self.device))
        for span in spans[:-1]:
            if span not in prefill_shape.chunk_steps:
                prefill_shape.chunk_steps[span] = capture(
                    chunk_step(prefill_shape, self._on_rows(), *span), prefill_shape.passes_over, "prefill_captures")
            self._prefill_pass(prefill_shape.chunk_steps[span], prefill_shape.passes_over, span,
                               self._scorer(prompts, prefill_shape, span[0]))
        if packed:
            if prefill_shape.packed_step is None:
                prefill_shape.packed_step = prefill_step(prefill_shape, self._on_rows(), self.rules, self._shares_prompts,
                                                         packed=True)
            self._prefill_pass(prefill_shape.packed_step, tuple(prefill_shape), spans[-1],
                               self._scorer(prompts, prefill_shape, None))
        else:
            if prefill_shape.step is None:
                prefill_shape.step = capture(
                    prefill_step(prefill_shape, self._on_rows(), self.rules, self._shares_prompts), tuple(prefill_shape),
                    "prefill_captures")
            self._prefill_pass(prefill_shape.step, tuple(prefill_shape), spans[-1],  # a captured step's run writes as a replay
                               self._scorer(prompts, prefill_shape, spans[-1][0]))
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

    def _prefill_pass(self, step: Callable[..., object], buffers: tuple[torch.Tensor, ...], span: tuple[int, int],
                      score: Callable[[torch.Tensor], None] | None = None) -> None:
        """One forward pass of a prefill, over positions ``span`` of its bucket, timed (the longest is kept); after a
        decode step of the running rows when a pass of this insertion ran before it and they have steps left. With
        ``score``, the pass's final hidden states are handed to it (its prompts scored)."""
        if self._passes_run and self._steps_left:
            with self._timed("decode_seconds"):
                self._decode_step()
            self._steps_left -= 1
            if not self._steps_left:  # the running rows have ended: none waits any more
                self._last_step_at = None
        self.accelerator.synchronize()
        started = time.perf_counter()
        with self.forward.final_hidden_states() if score else contextlib.nullcontext() as held:
            step(*buffers)
        if score:
            score(held[-1])
        self.accelerator.mark_step()
        self.accelerator.synchronize()
        self._passes_run += 1
        self.stats.prefill_passes += 1
        self.stats.longest_prefill_pass = max(self.stats.longest_prefill_pass, time.perf_counter() - started)
        if self._last_step_at is not None:  # rows wait on this pass
            self._positions_waited += span[1] - span[0]

    def _scorer(self, prompts: list[Row], prefill_shape: PrefillShape,
                start: int | None) -> Callable[[torch.Tensor], None] | None:
        """What scores ``prompts`` from the hidden states of a pass of their prefill shape (from bucket position
        ``start`` on; None: packed in one row), in a run that scores its prompts; else None."""
        if not self.scores_prompts:
            return None
        input_ids, prompt_mask = prefill_shape.input_ids, prefill_shape.prompt_mask

        def score(hidden: torch.Tensor) -> None:
            positions = (packed_positions(hidden, input_ids, prompt_mask, len(prompts)) if start is None
                         else padded_positions(hidden, input_ids, prompt_mask, start, len(prompts)))
            self._keep_scores(prompts, positions)

        return score

    def _keep_scores(self, prompts: list[Row], positions: ScoredPositions) -> None:
        """Score the ``positions`` of ``prompts``' tokens each row asks for, and keep their scores with the rows (read
        back to the host)."""
        def firsts(field: str) -> torch.Tensor:  # each prompt's first token index of ``field``, at each position
            values = torch.tensor([getattr(row.prompt_scores, field) for row in prompts], device=self.device)
            return values.index_select(0, positions.prompts)

        kept = positions.token_indices >= firsts("scored_from")
        if not bool(kept.all()):  # positions no row asks scores of: the head does not run on them
            positions = ScoredPositions(*(values[kept] for values in positions))
        greedy_wanted = positions.token_indices >= firsts("greedy_from")
        scores = score_positions(self.forward.head_logits, positions, self.model.config.vocab_size,
                                 self.run.prompt_logprobs, greedy_wanted)
        of_prompt, indices, logprobs, greedy, top_ids, top_logprobs, wanted = (
            values.tolist() for values in (positions.prompts, positions.token_indices, *scores, greedy_wanted))
        greedy = [flag if asked else None for flag, asked in zip(greedy, wanted)]
        by_prompt: dict[int, list[int]] = {}
        for place, prompt in enumerate(of_prompt):
            by_prompt.setdefault(prompt, []).append(place)
        for prompt, places in by_prompt.items():
            prompts[prompt].prompt_scores.fill(*([values[place] for place in places]
                                                 for values in (indices, logprobs, greedy, top_ids, top_logprobs)))

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
            limits, (temperatures, top_ps, seed_keys) = row_settings(rows)
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

    def _on_rows(self) -> RowsForward:
        """The model on the cache of the slots in use, for prefills into its rows."""
        return RowsForward(self.forward, self.shape.cache, self.shape.state.attention_mask.shape[1], self.rows_aligned)

    @property
    def _shares_prompts(self) -> bool:
        """Whether a prompt may start several rows (samples), each needing its prompt's keys and values."""
        return self.run.num_samples > 1 or self.run.rows_choose

    @contextlib.contextmanager
    def _timed(self, field: str) -> Iterator[None]:
        """Add the block's device-synchronised seconds to ``stats.<field>``."""
        self.accelerator.synchronize()
        started = time.perf_counter()
        yield
        self.accelerator.synchronize()
        setattr(self.stats, field, getattr(self.stats, field) + time.perf_counter() - started)
