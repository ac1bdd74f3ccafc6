"""Text in, text out through one engine: a scheduler of rows (``scheduler``) and a runner of slots (``runner``).

A ``Generator`` holds a loaded model (``accelgen.model.loaded_model``) and the run's settings. Each call
encodes the prompts (``text``), hands the rows to a fresh :class:`~accelgen.generation.scheduler.Scheduler`
whose plans the generator's one :class:`~accelgen.generation.runner.SlotRunner` carries out, and decodes the
rows it gives out, in the order given. The runner keeps its caches and captured steps between calls.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

import torch

from accelgen.common.errors import UsageError
from accelgen.common.prompts import PromptError, PromptRequest, ScoreRequest
from accelgen.common.settings import RowSettings, RunSettings
from accelgen.generation import decoding
from accelgen.generation.adapter_slots import AdapterSlots
from accelgen.generation.capture_decision import CaptureWhenItPays
from accelgen.generation.constraints import SlotConstraints
from accelgen.generation.grammars import GrammarCompiler
from accelgen.generation.prompt_scores import PromptScores
from accelgen.generation.reasoning import ThinkMarkers
from accelgen.generation.row_ends import RowEnds
from accelgen.generation.runner import SlotRunner
from accelgen.generation.scheduler import Row, Scheduler
from accelgen.generation.scoring import PARTS, ScoreParts
from accelgen.generation.stats import BatchTiming, GenerationStats
from accelgen.generation.text import Completion, PromptCodec, PromptSamples, SampleCompletion, eos_token_ids
from accelgen.model.loaded_model import LoadedModel
from accelgen.model.shape import context_limit
from accelgen.model.transformers_adapter.forward import ModelForward

__all__ = ["BatchTiming", "Completion", "GenerationStats", "Generator"]


class EncodedPrompt(NamedTuple):
    """A prompt on its way into the scheduler: its number, its token ids (a string: why it is an error row), its own
    settings (None: the run's), whether it is a conversation (a prompt too long is told what shortens one), and the
    first of its samples to make."""

    number: int
    ids: list[int] | str
    own: RowSettings | None = None
    conversation: bool = False
    first_sample: int = 0
    scores: PromptScores | None = None  # a score request's prompt: what of it is scored


class Generator:
    """Generates completions with one loaded model, with static shapes."""

    def __init__(self, loaded: LoadedModel, run: RunSettings, adapter_slots: AdapterSlots | None = None,
                 capture_later: CaptureWhenItPays | None = None):
        """A generator of ``loaded`` for ``run``; ``adapter_slots``: what the LoRA adapters' buffers hold, when another
        generator of the same model filled them (they are the model's); ``capture_later``: when to capture the decode
        step of a run that starts eagerly (``accelgen.generation.capture_decision``)."""
        self.loaded, self.run = loaded, run
        self.capture_later = capture_later
        #: called as the step is captured later (a long capture holds the rows up: the caller may say why)
        self.on_capture: Callable[[], None] | None = None
        self.model, self.tokenizer, self.accelerator = loaded.model, loaded.tokenizer, loaded.accelerator
        self.world = loaded.world
        self.stats = GenerationStats()
        markers = ThinkMarkers.of(self.tokenizer)
        eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.text = PromptCodec(self.tokenizer, self.model.config.vocab_size, run, markers, eos_ids)
        #: which adapter each buffer slot holds, None where rows do not choose adapters
        self.adapter_slots = adapter_slots or (AdapterSlots(loaded.adapters.slots) if loaded.adapters else None)
        forward = ModelForward(self.model, self.world, run.torch_dtype, loaded.adapters)
        self.batching = forward.batching(run.batching)  # "continuous" or "static": how rows share the slots
        self.ends = RowEnds(self.text, eos_ids, run.ignore_eos)
        rules = decoding.TokenRules(
            sampling=run.sampling, ending_tokens=decoding.ending_table(eos_ids, loaded.device),
            pad_token_id=self.tokenizer.pad_token_id, stop_at_eos=not run.ignore_eos, logprobs=run.logprobs,
            per_row=run.rows_choose, constrained=run.constrained, device_draw=self.accelerator.token_draw(),
        )
        self.constraints = SlotConstraints(GrammarCompiler(self.tokenizer, self.model.config.vocab_size, eos_ids),
                                           run.batch_size, markers, run.skip_bad_rows) if run.constrained else None
        self.runner = SlotRunner(forward, self.accelerator, loaded.device, run, self.world, rules, self.stats,
                                 self.constraints)
        self._scorers: dict[int, Generator] = {}  # generators of the same model that score rows, by alternatives

    def with_batch_size(self, batch_size: int) -> "Generator":
        """A generator of the same model for another batch size (its own caches and graphs)."""
        return Generator(self.loaded, dataclasses.replace(self.run, batch_size=batch_size), self.adapter_slots)

    def scoring(self, alternatives: int = 0) -> "Generator":
        """A generator of the same model that scores rows (:meth:`score`), each token with its ``alternatives`` most
        likely ones: this one where it scores so already, else one of its own (its caches), made once."""
        if self.run.prompt_logprobs == alternatives and self.run.max_new_tokens == 1:
            return self
        scorers = self._scorers
        if alternatives not in scorers:
            scorers[alternatives] = Generator(self.loaded, dataclasses.replace(
                self.run, prompt_logprobs=alternatives, max_new_tokens=1, num_samples=1, use_graphs=False,
                structure=None, structured_rows=False, logprobs=False), self.adapter_slots)
        return scorers[alternatives]

    def score(self, requests: Sequence[ScoreRequest | str], alternatives: int = 0) -> list[Completion]:
        """Each request scored, in order (a text alone: its tokens scored): its completion's ``prompt_scores`` hold
        its text's tokens' log-probabilities (``alternatives``: with that many most likely tokens at each), its
        ``continuations`` each continuation's log-likelihood after it (``accelgen.generation.scoring``)."""
        requests = [request if isinstance(request, ScoreRequest) else ScoreRequest(request) for request in requests]
        return [completion for batch in self.scoring(alternatives).generate_batches(requests) for completion in batch]

    @property
    def capture_failure(self) -> str | None:
        """Why the accelerator could not capture the decode step (then it runs eagerly), or None."""
        return self.runner.capture_failure

    @property
    def cache_length_in_use(self) -> int | None:
        """Positions per row of the KV cache memory this generator holds (its largest cache), None before any."""
        return self.runner.cache_length_in_use

    # -- text in, text out ----------------------------------------------------------------------

    def generate(self, prompts: Sequence[str], adapters: Sequence[str | None] | None = None) -> list[Completion]:
        """Completions for ``prompts``, in order; ``adapters``: the LoRA adapter of each prompt, by name (None: the base
        model), among those the model was loaded with (``lora``)."""
        if adapters is not None:
            if len(adapters) != len(prompts):
                raise UsageError(f"{len(adapters)} adapters for {len(prompts)} prompts: name one adapter (or None) per prompt.")
            prompts = [PromptRequest(prompt, RowSettings(adapter=adapter or None), None)
                       for prompt, adapter in zip(prompts, adapters)]
        return [completion for batch in self.generate_batches(prompts) for completion in batch]

    def generate_batches(self, prompts: Iterable[str], first_index: int = 0) -> Iterator[list[Completion]]:
        """Completions as rows are given out, numbered from ``first_index``, so callers can write as they go.
        ``prompts`` may be any iterable (a streamed dataset): it is read as slots free up."""
        yield from self.generate_numbered(enumerate(prompts, start=first_index))

    def generate_numbered(self, numbered_prompts: Iterable[tuple[int, str]]) -> Iterator[list[Completion]]:
        """Completions of (number, prompt) pairs, in the order given, a list at a time. The numbers need not
        follow each other (a data-parallel replica gets the rows it is handed): a prompt's number alone, not
        its place among the others, decides its sampling draws and names it in errors."""
        prompts = PromptSamples()
        for samples in self.generate_samples(numbered_prompts):
            completions = [completion for sample in samples if (completion := prompts.add(sample)) is not None]
            if completions:
                yield completions

    def generate_samples(self, numbered_prompts: Iterable[tuple[int, str]],
                         first_samples: dict[int, int] | None = None) -> Iterator[list[SampleCompletion]]:
        """Each sample's completion of (number, prompt) pairs as its row ends, in order (a prompt's samples one after
        another), a list at each look: a prompt of many samples is seen to progress, and what it has done can be kept.
        ``first_samples``: by prompt number, the first sample to make (those before it were made by a stopped run:
        each sample's draws depend only on the seed, its prompt's number, its own and the step)."""
        texts: dict[int, tuple[str, bool]] = {}  # by number: the prompt, and whether it was truncated
        first_samples = first_samples or {}
        scores = ScoreParts(self.text, self.run.skip_bad_rows)
        alternatives = self.run.prompt_logprobs or 0
        scored: set[int] = set()  # the numbers of the score requests' prompts not yet out

        def encoded() -> Iterator[EncodedPrompt]:
            for number, prompt in numbered_prompts:
                if isinstance(prompt, ScoreRequest):
                    if self.run.prompt_logprobs is None:
                        raise UsageError("Score requests go to a generator that scores: call generator.score(requests), "
                                         "or load with prompt_logprobs=0.")
                    encoded_request = scores.encode(number, prompt)
                    for part, ids in encoded_request.parts:
                        scored.add(part)
                        yield EncodedPrompt(part, ids, scores=None if isinstance(ids, str)
                                            else encoded_request.scores_of(ids, alternatives))
                    continue
                ids, truncated = self.text.encode_row(number, prompt, self.run.skip_bad_rows)
                texts[number] = (prompt, truncated)
                conversation = not isinstance(ids, str) and self.text.conversation(prompt) is not None
                yield EncodedPrompt(number, ids, prompt.settings if isinstance(prompt, PromptRequest) else None,
                                    conversation, first_samples.get(number, 0))

        for rows in self._scored_numbers(self._run_rows(encoded()), scored):
            samples = []
            for row in rows:
                if row.number in scored:  # a score request's: its completion once its last prompt is out
                    scored.discard(row.number)
                    if (completion := scores.gather(row)) is not None:
                        samples.append(SampleCompletion(completion, 0, 1))
                    continue
                tokens, reason = self.ends.trim(row)
                self.stats.new_tokens += len(tokens)
                samples.append(SampleCompletion(self.text.completion(row, *texts[row.number], tokens, reason),
                                                row.sample, row.samples))
                if samples[-1].ends_prompt:
                    del texts[row.number]
            yield samples

    @staticmethod
    def _scored_numbers(rows: Iterator[list[Row]], scored: set[int]) -> Iterator[list[Row]]:
        """``rows``, a prompt refused by the engine named by its score request's number where it is one of its."""
        try:
            yield from rows
        except PromptError as error:
            if error.number in scored:
                raise PromptError(error.number // PARTS, error.rest) from None
            raise

    def generate_token_ids(self, prompts: Sequence[Sequence[int]], first_index: int = 0) -> list[tuple[list[int], str]]:
        """New token ids and finish reason per tokenized prompt, numbered from ``first_index``."""
        numbered = (EncodedPrompt(number, list(ids)) for number, ids in enumerate(prompts, start=first_index))
        rows = [row for ready in self._run_rows(numbered) for row in ready]
        return [self.ends.trim(row) for row in rows]

    # -- the engine -------------------------------------------------------------------------------

    @torch.no_grad()
    def _run_rows(self, numbered_ids: Iterable[EncodedPrompt]) -> Iterator[list[Row]]:
        """Rows through the slots: read as the scheduler has room, run by the runner, given out in order (each
        prompt's as many rows as it has samples left to make); a prompt given as a string is an error row. One that cannot be
        read or used stops the run once the rows read before it are given out (or, with --skip-bad-rows, ends as
        an error row)."""
        run, runner, stats = self.run, self.runner, self.stats
        scheduler = Scheduler(run, self.batching, context_limit(self.model.config),
                              self.accelerator.tuning.prefill_pass_steps, self.adapter_slots)
        before = (stats.prefill_seconds, stats.decode_seconds, stats.decode_steps)
        source, source_error = iter(numbered_ids), None
        while True:
            read = 0
            try:
                for prompt in itertools.islice(source, scheduler.room()):
                    if isinstance(prompt.ids, str):
                        scheduler.add_error(prompt.number, prompt.ids)
                    else:
                        row = scheduler.add(prompt.number, prompt.ids, prompt.own, prompt.conversation, prompt.first_sample)
                        if row.error is None:  # a score request's prompt says what of it is scored
                            row.prompt_scores = prompt.scores
                    read += 1
            except Exception as error:  # noqa: BLE001 - raised once the rows before it are out
                source, source_error = iter(()), error
            plan = scheduler.plan()
            if plan is None:  # nothing to run: error rows alone were read, or none at all
                if ready := scheduler.finish():
                    yield ready
                if read:
                    continue
                break
            if plan.insertion is not None:
                runner.use_bucket(plan.cache_bucket)
                scheduler.decoded_between(runner.insert(plan.insertion), plan.insertion)
            runner.decode(plan.steps)
            ended = scheduler.collect(self.ends.with_stopped(runner.finished_slots(), scheduler.running, runner))
            ready = scheduler.finish(*runner.read_back(ended))
            if self.capture_later is not None and self.capture_later.pays_now(scheduler.rows_ended,
                                                                              scheduler.steps_of_ended_rows):
                self._capture_now()
            if ready:
                stats.batches += 1
                self._count_adapter_rows(ready)
                yield ready
        stats.timings.append(BatchTiming(stats.prefill_seconds - before[0], stats.decode_seconds - before[1],
                                         stats.decode_steps - before[2]))
        if self.constraints is not None:
            stats.constrained_rows = self.constraints.rows_started
            stats.grammar_compile_seconds = self.constraints.compile_seconds
        if source_error is not None:
            raise source_error

    def _capture_now(self) -> None:
        """Capture the decode step from here on: the rows so far say the rows left pay for it."""
        self.capture_later = None
        self.run = dataclasses.replace(self.run, use_graphs=True)
        if self.on_capture is not None:
            self.on_capture()
        self.runner.capture_now()

    def _count_adapter_rows(self, rows: list[Row]) -> None:
        """Count the prompts of ``rows`` per LoRA adapter ("": the base model), where rows choose adapters."""
        if self.adapter_slots is None:
            return
        for row in rows:
            if row.sample == 0 and row.error is None:
                name = row.settings.adapter or ""
                self.stats.adapter_rows[name] = self.stats.adapter_rows.get(name, 0) + 1
