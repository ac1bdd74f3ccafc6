"""The generation pipeline on token ids: pad to a bucket, prefill a static cache, replay one captured step.

One ``Generator`` holds a prepared model on one accelerator. For each static shape (bucket length,
cache length) it keeps a ``DecodeSlot``: the KV cache and the fixed-address buffers the decode step
reads and writes (``accelgen.generation.decoding``), so a later batch of the same bucket replays the
graph captured for the first one. The caches of all slots share one storage (``kv_cache``), sized for
the largest cache in use: a generator holds one cache's memory, whatever the prompt lengths it meets.
Text in and out goes through ``accelgen.generation.text``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from accelgen.common.errors import AccelgenWarning, GraphCaptureWarning, UsageError, first_line
from accelgen.common.prompts import PromptError
from accelgen.common.settings import RunSettings, World
from accelgen.generation import decoding
from accelgen.generation.continuous import ContinuousBatcher
from accelgen.generation.kv_cache import CacheStorage, new_static_cache, rewind_static_cache
from accelgen.generation.model_forward import ModelForward
from accelgen.generation.text import Completion, PromptCodec, eos_token_ids
from accelgen.model.architectures import architecture_of
from accelgen.model.memory import check_cache_fits
from accelgen.model.shape import context_limit
from accelgen.plugin.contract import Accelerator

__all__ = ["BatchTiming", "Completion", "GenerationStats", "Generator"]

#: Decode steps between checks that every row has finished (each check waits for the device).
EOS_CHECK_INTERVAL = 8


@dataclasses.dataclass
class BatchTiming:
    """Device-synchronised timings of one batch."""

    prefill_seconds: float  # the prompt forward pass and the first token
    decode_seconds: float  # every later token
    decode_steps: int  # how many tokens the decode loop produced (new tokens - 1 when not stopped early)

    @property
    def seconds_per_decode_step(self) -> float:
        return self.decode_seconds / max(self.decode_steps, 1)


@dataclasses.dataclass
class GenerationStats:
    graph_captures: int = 0  # of decode steps (one per static shape, or the one slot step)
    prefill_captures: int = 0  # of prefill shapes (continuous batching: a few row counts times the buckets)
    capture_seconds: float = 0.0  # spent capturing (compiling, where the device compiles), not in any timing
    batches: int = 0  # fixed batches run, or looks at the slots that gave out rows (continuous batching)
    prefills: int = 0  # prefill forward passes (one per fixed batch; one per insertion into slots)
    new_tokens: int = 0  # tokens given out: each row's new tokens up to its end
    slot_tokens: int = 0  # token places computed: rows of every prefill shape and every row of every step
    timings: list[BatchTiming] = dataclasses.field(default_factory=list)

    @property
    def slot_occupancy(self) -> float | None:
        """The share of computed token places that produced a kept token."""
        return self.new_tokens / self.slot_tokens if self.slot_tokens else None


@dataclasses.dataclass
class DecodeSlot:
    """Everything one static shape (bucket length, cache length) needs, kept between batches."""

    bucket_length: int
    cache: object  # transformers StaticCache, [B, heads, L, head_dim] per layer
    state: decoding.DecodeState  # the buffers the decode step reads and writes
    forward: decoding.Forward  # the model called on this slot's cache
    decode_step: Callable[..., object] | None = None  # decode_step(*state): captured, or plain


class Timer:
    """Seconds a timed block took (set when the block ends)."""

    seconds: float = 0.0


class Generator:
    """Generates completions with one model on one accelerator, with static shapes."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        accelerator: Accelerator,
        device: torch.device,
        run: RunSettings,
        world: World = World(),
        unsharded_parameter_bytes: int | None = None,
        capture_failure: str | None = None,
        loading_host_memory: dict[str, int] | None = None,
        placement: Any = None,
    ):
        self.model, self.tokenizer, self.accelerator = model, tokenizer, accelerator
        self.device, self.run, self.world = device, run, world
        self.stats = GenerationStats()
        # Facts of how the model was loaded, kept for reports (generation does not read them): its parameter
        # bytes before any split, this process's host memory around loading, and where an offloaded model's
        # weights sit (``accelgen.loading.offload.Placement``; None: not offloaded).
        self.unsharded_parameter_bytes = unsharded_parameter_bytes
        self.loading_host_memory = loading_host_memory or {}
        self.placement = placement
        #: Why the accelerator could not capture the decode step (then it runs eagerly), or None.
        self.capture_failure = capture_failure
        self.text = PromptCodec(tokenizer, model.config.vocab_size, run.max_input_tokens)
        #: "continuous" or "static": how rows share the batch (``run.batching``, unless the model cannot)
        self.batching = self._batching_mode()
        self._batcher: ContinuousBatcher | None = None
        self._slots: dict[tuple[int, int], DecodeSlot] = {}
        self._cache_storage: CacheStorage | None = None
        self._model_forward = ModelForward(model, world, run.torch_dtype)
        self._context_limit = context_limit(model.config)
        self.pad_token_id = tokenizer.pad_token_id
        eos_ids = eos_token_ids(model, tokenizer)
        self._eos_token_id_set = set(eos_ids)
        self._rules = decoding.TokenRules(
            sampling=run.sampling, eos_token_ids=torch.tensor(eos_ids, dtype=torch.long, device=device),
            pad_token_id=self.pad_token_id, stop_at_eos=not run.ignore_eos,
        )

    # -- text in, text out ----------------------------------------------------------------------

    def with_batch_size(self, batch_size: int) -> "Generator":
        """A generator sharing this one's model for another fixed batch size (its own caches and graphs)."""
        return Generator(
            self.model, self.tokenizer, self.accelerator, self.device, dataclasses.replace(self.run, batch_size=batch_size),
            self.world, self.unsharded_parameter_bytes, self.capture_failure, self.loading_host_memory, self.placement,
        )

    def generate(self, prompts: Sequence[str]) -> list[Completion]:
        """Completions for ``prompts``, in order."""
        return [completion for batch in self.generate_batches(prompts) for completion in batch]

    def generate_batches(self, prompts: Iterable[str], first_index: int = 0) -> Iterator[list[Completion]]:
        """Completions batch by batch (``run.batch_size`` prompts each), so callers can write as they go.

        ``prompts`` may be any iterable (a streamed dataset): it is read one batch at a time.
        ``first_index`` numbers the prompts; a prompt's number (not its batch) decides its sampling draws,
        so a run resumed at any prompt samples what an uninterrupted run did."""
        yield from self.generate_numbered(enumerate(prompts, start=first_index))

    def generate_numbered(self, numbered_prompts: Iterable[tuple[int, str]]) -> Iterator[list[Completion]]:
        """Completions of (number, prompt) pairs, in the order given, a batch at a time (none for no prompts:
        the command line and the Python API refuse an empty list before loading). The numbers need not
        follow each other (a data-parallel replica gets the rows it is handed): a prompt's number alone, not
        its place among the others, decides its sampling draws and names it in errors."""
        if self.batching == "continuous":
            yield from self._generate_continuously(numbered_prompts)
            return
        remaining = iter(numbered_prompts)
        while batch := list(itertools.islice(remaining, self.run.batch_size)):
            encoded = [self._encode(number, prompt) for number, prompt in batch]
            outputs = self._generate_rows([ids for ids, _ in encoded], [number for number, _ in batch])
            yield [
                self.text.completion(number, prompt, ids, truncated, *output)
                for (number, prompt), (ids, truncated), output in zip(batch, encoded, outputs)
            ]

    def tokenize(self, prompts: Sequence[str], first_index: int = 0) -> tuple[list[list[int]], list[bool]]:
        """Token ids per prompt (truncated to ``run.max_input_tokens``), and which prompts were truncated."""
        return self.text.encode(prompts, first_index)

    def _encode(self, number: int, prompt: str) -> tuple[list[int], bool]:
        """Prompt ``number``'s token ids, and whether they were truncated."""
        [ids], [truncated] = self.tokenize([prompt], first_index=number)
        return ids, truncated

    # -- token ids in, token ids out ------------------------------------------------------------

    def generate_token_ids(self, prompts: Sequence[Sequence[int]], first_index: int = 0) -> list[tuple[list[int], str]]:
        """New token ids and finish reason per prompt, for at most ``run.batch_size`` tokenized prompts
        numbered from ``first_index``: prefill, capture the decode step if this shape has none yet, decode."""
        return self._generate_rows(prompts, list(range(first_index, first_index + len(prompts))))

    @torch.no_grad()
    def _generate_rows(self, prompts: Sequence[Sequence[int]], numbers: list[int]) -> list[tuple[list[int], str]]:
        """:meth:`generate_token_ids` for prompts with any ``numbers``."""
        run = self.run
        if not 0 < len(prompts) <= run.batch_size:
            raise ValueError(f"expected 1 to {run.batch_size} prompts, got {len(prompts)}")
        lengths = [len(ids) for ids in prompts]
        try:
            bucket_length = decoding.choose_bucket(max(lengths), run.buckets, self._context_limit, run.max_new_tokens)
        except UsageError as error:  # said of the longest row, as the continuous batcher says it
            raise PromptError(numbers[lengths.index(max(lengths))], f": {error}") from None
        slot = self._slot(bucket_length)
        with self._timed() as prefill:
            restart = self._prefill(slot, prompts, numbers)
        if slot.decode_step is None and run.max_new_tokens > 1:
            self._make_decode_step(slot, restart)
        with self._timed() as decoding_time:
            steps = decoding.decode_n_tokens(
                slot.decode_step, slot.state, run.max_new_tokens - 1, stop_when_finished=self._rules.stop_at_eos,
                check_every=EOS_CHECK_INTERVAL, after_step=self.accelerator.mark_step,
            )
        outputs = [self._trim(row_tokens) for row_tokens in slot.state.new_tokens[: len(prompts)].tolist()]
        self.stats.batches += 1
        self.stats.prefills += 1
        self.stats.new_tokens += sum(len(tokens) for tokens, _ in outputs)
        self.stats.slot_tokens += run.batch_size * (steps + 1)
        self.stats.timings.append(BatchTiming(prefill.seconds, decoding_time.seconds, steps))
        return outputs

    @property
    def cache_length_in_use(self) -> int | None:
        """Positions per row of the KV cache memory this generator holds (its largest cache), None before any."""
        return self._cache_storage.capacity if self._cache_storage else None

    # -- the steps of a batch -------------------------------------------------------------------

    def _prefill(self, slot: DecodeSlot, prompts: Sequence[Sequence[int]], numbers: list[int]) -> Callable[[], None]:
        """Start a batch in ``slot``: run the padded prompts through the model (filling the cache), choose each
        row's first token and set the decode buffers from it. Returns what sets them again (after a capture
        that ran the step)."""
        state, bucket_length = slot.state, slot.bucket_length
        input_ids, prompt_mask = decoding.left_pad(prompts, bucket_length, self.run.batch_size, self.pad_token_id)
        input_ids, prompt_mask = input_ids.to(self.device), prompt_mask.to(self.device)
        slot.cache.reset()
        state.attention_mask.zero_()
        state.attention_mask[:, :bucket_length].copy_(prompt_mask)
        padding_numbers = range(numbers[-1] + 1, numbers[-1] + 1 + self.run.batch_size - len(numbers))
        state.row_indices.copy_(torch.tensor([*numbers, *padding_numbers]))
        first_tokens = decoding.prefill(slot.forward, state, input_ids, prompt_mask, self._rules)
        prompt_lengths = prompt_mask.sum(-1, keepdim=True)

        def start_decoding() -> None:
            decoding.start_decoding(state, first_tokens, prompt_lengths, self._rules)
            self.accelerator.mark_step()

        start_decoding()
        return start_decoding

    def _make_decode_step(self, slot: DecodeSlot, restart: Callable[[], None]) -> None:
        """The slot's decode step: captured by the accelerator when graphs are on and capture works, else the
        plain step. A capture may run the step (to warm up or compile), which moves the batch on: then the
        batch's decoding starts again, its cache rewound to the prompt.

        Any failure to capture (other than running out of memory) leaves the step eager, with one warning:
        the eager step runs the very same code, so a real bug in it still surfaces there, as itself."""
        forward, rules = slot.forward, self._rules

        def decode_step(*buffers: torch.Tensor) -> torch.Tensor:
            return decoding.decode_one_token(forward, decoding.DecodeState(*buffers), rules)

        slot.decode_step = decode_step
        if not self.run.use_graphs or self.capture_failure is not None:
            return
        slot.decode_step = self._captured(decode_step, tuple(slot.state))
        restart()  # the capture, or the attempt, may have run the step
        rewind_static_cache(slot.cache, slot.bucket_length)

    def _captured(self, step: Callable[..., torch.Tensor], buffers: tuple[torch.Tensor, ...],
                  counter: str = "graph_captures") -> Callable[..., object]:
        """``step`` captured by the accelerator over ``buffers`` when graphs are on and capture works, else
        ``step`` itself (after a failure other than running out of memory: with one warning). A capture
        counts in ``stats.<counter>``."""
        if not self.run.use_graphs or self.capture_failure is not None:
            return step
        started = time.perf_counter()
        try:
            captured = self.accelerator.capture(step, buffers, self.run)
        except Exception as error:  # noqa: BLE001 - see _make_decode_step's docstring
            if self.accelerator.is_out_of_memory(error):
                raise
            self.capture_failure = first_line(error)
            warnings.warn(
                f"the {self.accelerator.name} accelerator cannot capture the decode step of this "
                f"{self.model.config.model_type} model ({self.capture_failure}); running it eagerly: same output, "
                f"slower (pass --no-graphs to skip the attempt)",
                GraphCaptureWarning, stacklevel=4,
            )
            return step
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        self.stats.capture_seconds += time.perf_counter() - started
        return captured

    @contextlib.contextmanager
    def _timed(self) -> Iterator[Timer]:
        """Time the block between two ``synchronize`` calls: all the device work it queued, and nothing before."""
        timer = Timer()
        self.accelerator.synchronize()
        started = time.perf_counter()
        yield timer
        self.accelerator.synchronize()
        timer.seconds = time.perf_counter() - started

    # -- continuous batching ----------------------------------------------------------------------

    def _batching_mode(self) -> str:
        """``run.batching``, or "static" (with one warning) for a model whose slot step cannot be built: one
        that does not take the core's 4D attention mask, which alone tells each row what it sees."""
        if self.run.batching != "continuous" or architecture_of(self.model.config).takes_4d_mask:
            return self.run.batching
        warnings.warn(AccelgenWarning(
            f"{self.model.config.model_type} models run in fixed batches (--batching static): their attention "
            f"masks are built by Hugging Face from one position for the whole batch, which slots do not share"),
            stacklevel=3)
        return "static"

    def _generate_continuously(self, numbered_prompts: Iterable[tuple[int, str]]) -> Iterator[list[Completion]]:
        """Completions in the order given, through the slots of :mod:`accelgen.generation.continuous`."""
        texts: dict[int, tuple[str, list[int], bool]] = {}  # the rows in flight: prompt, token ids, truncated

        def tokenized() -> Iterator[tuple[int, list[int]]]:
            for index, prompt in numbered_prompts:
                ids, truncated = self._encode(index, prompt)
                texts[index] = (prompt, ids, truncated)
                yield index, ids

        batcher = self._continuous_batcher()
        with torch.no_grad():
            for ready in batcher.run(tokenized()):
                completions = []
                for index, row_tokens in ready:
                    prompt, ids, truncated = texts.pop(index)
                    tokens, reason = self._trim(row_tokens)
                    self.stats.new_tokens += len(tokens)
                    completions.append(self.text.completion(index, prompt, ids, truncated, tokens, reason))
                self.stats.batches += 1
                yield completions
        run = batcher.stats  # this run's
        self.stats.slot_tokens += self.run.batch_size * run.decode_steps + run.prefill_rows
        self.stats.prefills += run.prefills
        self.stats.timings.append(BatchTiming(run.prefill_seconds, run.decode_seconds, run.decode_steps))

    def _continuous_batcher(self) -> ContinuousBatcher:
        if self._batcher is None:
            self._batcher = ContinuousBatcher(
                slots=self.run.batch_size, max_new_tokens=self.run.max_new_tokens, buckets=self.run.buckets,
                context_limit=self._context_limit, pad_token_id=self.pad_token_id, device=self.device,
                rules=self._rules, model=self.model, dtype=self.run.torch_dtype, forward=self._model_forward,
                make_storage=self._slot_storage, capture=self._captured,
                capture_prefill=functools.partial(self._captured, counter="prefill_captures"),
                mark_step=self.accelerator.mark_step,
                synchronize=self.accelerator.synchronize,
            )
        return self._batcher

    def _slot_storage(self, slots: int, cache_length: int) -> CacheStorage:
        """The memory of the slot step's cache (this generator's one cache storage, checked against the device)."""
        self._slots.clear()
        self._cache_storage = None
        self._make_room_for(cache_length)
        return self._cache_storage

    # -- per static shape -----------------------------------------------------------------------

    def _slot(self, bucket_length: int) -> DecodeSlot:
        cache_length = bucket_length + self.run.max_new_tokens
        key = (bucket_length, cache_length)
        if key not in self._slots:
            self._make_room_for(cache_length)
            cache = new_static_cache(self.model, cache_length, self.run.torch_dtype, self.device, self._cache_storage)
            self.accelerator.mark_step()  # on transformers 4.55 that ran a forward pass (its shape probe)
            self._slots[key] = DecodeSlot(
                bucket_length=bucket_length,
                cache=cache,
                state=decoding.DecodeState.allocate(self.run.batch_size, cache_length, self.run.max_new_tokens, self.device),
                forward=functools.partial(self._model_forward, cache=cache),
            )
        return self._slots[key]

    def _make_room_for(self, cache_length: int) -> None:
        """A cache storage of at least ``cache_length`` positions, checked against the device's free memory. A
        larger one replaces the old, and the slots whose caches (and graphs) lived in the old one go first."""
        if self._cache_storage is not None and cache_length <= self._cache_storage.capacity:
            return
        self._slots.clear()
        self._cache_storage = None
        check_cache_fits(self.model.config, dtype=self.run.dtype, batch_size=self.run.batch_size, cache_length=cache_length,
                         world_size=self.world.size, device_name=self.accelerator.name,
                         free_bytes=self.accelerator.memory_stats().get("free_bytes"),
                         device_is_host=self.accelerator.shares_host_memory)
        self._cache_storage = CacheStorage(self.run.batch_size, cache_length)

    def _trim(self, row_tokens: list[int]) -> tuple[list[int], str]:
        """The new tokens up to and including the first EOS (all of them with ignore_eos)."""
        if not self.run.ignore_eos:
            for position, token in enumerate(row_tokens):
                if token in self._eos_token_id_set:
                    return row_tokens[: position + 1], "eos"
        return row_tokens, "length"
