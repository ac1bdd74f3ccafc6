"""The generation pipeline: tokenize, pad to a bucket, prefill a static cache, replay one captured step.

One ``Generator`` holds a prepared model on one accelerator. For each static shape (bucket length,
cache length) it keeps a ``DecodeSlot``: the KV cache and the fixed-address buffers the decode step
reads and writes (``accelgen.generation.decoding``), so a later batch of the same bucket replays the graph
captured for the first one. The caches of all slots share one storage (``accelgen.generation.kv_cache``), sized
for the largest cache in use: a generator holds one cache's memory, whatever the prompt lengths it meets.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
import warnings
from typing import Callable, Iterable, Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from accelgen.common.errors import GraphCaptureWarning, UsageError, first_line
from accelgen.common.prompts import check_prompts
from accelgen.common.settings import RunSettings, World
from accelgen.generation import decoding
from accelgen.generation.kv_cache import CacheStorage, new_static_cache, rewind_static_cache
from accelgen.generation.model_forward import ModelForward
from accelgen.model.memory import check_cache_fits
from accelgen.model.shape import context_limit
from accelgen.plugin.contract import Accelerator

#: Decode steps between checks that every row has finished (each check waits for the device).
EOS_CHECK_INTERVAL = 8


@dataclasses.dataclass
class Completion:
    """One prompt's result. ``prompt`` is the text the model saw (the kept tokens, when truncated);
    ``completion`` is the new text only; ``index`` the prompt's position (its row in a dataset)."""

    index: int
    prompt: str
    completion: str
    completion_token_ids: list[int]
    prompt_token_count: int
    finish_reason: str  # "eos" (the model ended it) or "length" (max_new_tokens reached)


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
    graph_captures: int = 0
    capture_seconds: float = 0.0  # spent capturing (compiling, where the device compiles), not in any timing
    batches: int = 0
    new_tokens: int = 0
    timings: list[BatchTiming] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class DecodeSlot:
    """Everything one static shape (bucket length, cache length) needs, kept between batches."""

    cache: object  # transformers StaticCache, [B, heads, L, head_dim] per layer
    state: decoding.DecodeState  # the buffers the decode step reads and writes
    forward: decoding.Forward  # the model called on this slot's cache
    decode_step: Callable[..., object] | None = None  # decode_step(*state): captured, or plain


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
        placement: object | None = None,
    ):
        self.model, self.tokenizer, self.accelerator = model, tokenizer, accelerator
        self.device, self.run, self.world = device, run, world
        self.stats = GenerationStats()
        self.unsharded_parameter_bytes = unsharded_parameter_bytes  # the model before sharding, for reports
        #: ``host_bytes_before_loading`` and ``peak_host_bytes_loading`` of this process, for reports.
        self.loading_host_memory = loading_host_memory or {}
        #: Where an offloaded model's weights sit and what has been moved to the device (None: not offloaded).
        self.placement = placement
        #: Why the accelerator could not capture the decode step (then it runs eagerly), or None.
        self.capture_failure = capture_failure
        self._slots: dict[tuple[int, int], DecodeSlot] = {}
        self._cache_storage: CacheStorage | None = None
        self._model_forward = ModelForward(model, world, getattr(torch, run.dtype))
        self._context_limit = context_limit(model.config)
        self.pad_token_id = tokenizer.pad_token_id
        eos_token_ids = _eos_token_ids(model, tokenizer)
        self._eos_token_id_set = set(eos_token_ids.tolist())
        self._rules = decoding.TokenRules(
            sampling=run.sampling, eos_token_ids=eos_token_ids.to(device), pad_token_id=self.pad_token_id,
            stop_at_eos=not run.ignore_eos,
        )

    # -- public ---------------------------------------------------------------------------------

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
        remaining = iter(prompts)
        index = first_index
        while batch := list(itertools.islice(remaining, self.run.batch_size)):
            token_ids, truncated = self.tokenize(batch, first_index=index)
            outputs = self.generate_token_ids(token_ids, first_index=index)
            yield [
                self._completion(index + row, batch[row], token_ids[row], truncated[row], *outputs[row])
                for row in range(len(batch))
            ]
            index += len(batch)
        if index == 0:
            raise UsageError("No prompts given: pass at least one prompt.")

    def tokenize(self, prompts: Sequence[str], first_index: int = 0) -> tuple[list[list[int]], list[bool]]:
        """Token ids per prompt, truncated to their first ``run.max_input_tokens`` tokens, and which
        prompts were truncated. ``first_index`` is the first prompt's number, for error messages."""
        check_prompts(prompts, first_index)
        token_ids = self.tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
        limit = self.run.max_input_tokens
        truncated = [limit is not None and len(ids) > limit for ids in token_ids]
        token_ids = [ids[:limit] for ids in token_ids] if limit is not None else token_ids
        vocab_size = self.model.config.vocab_size
        for index, ids in enumerate(token_ids, start=first_index):
            if not ids:
                raise UsageError(f"Prompt {index} makes no tokens: give it some text (or drop that row from the dataset).")
            if max(ids) >= vocab_size:
                raise UsageError(
                    f"Prompt {index} has token id {max(ids)}, outside the model's vocabulary of {vocab_size}: "
                    f"the tokenizer does not belong to this model."
                )
        return token_ids, truncated

    @torch.no_grad()
    def generate_token_ids(
        self, prompts: Sequence[Sequence[int]], first_index: int = 0
    ) -> list[tuple[list[int], str]]:
        """New token ids and finish reason per prompt, for at most ``run.batch_size`` tokenized prompts
        numbered from ``first_index``."""
        run = self.run
        if not 0 < len(prompts) <= run.batch_size:
            raise ValueError(f"expected 1 to {run.batch_size} prompts, got {len(prompts)}")
        bucket_length = decoding.choose_bucket(
            max(len(ids) for ids in prompts), run.buckets, self._context_limit, run.max_new_tokens
        )
        input_ids, prompt_mask = decoding.left_pad(prompts, bucket_length, run.batch_size, self.pad_token_id)
        input_ids, prompt_mask = input_ids.to(self.device), prompt_mask.to(self.device)
        prompt_lengths = prompt_mask.sum(-1, keepdim=True)
        slot = self._slot(bucket_length)
        state = slot.state
        slot.cache.reset()
        state.attention_mask.zero_()
        state.attention_mask[:, :bucket_length].copy_(prompt_mask)
        state.row_indices.copy_(torch.arange(first_index, first_index + run.batch_size))

        self.accelerator.synchronize()
        started = time.perf_counter()
        first_tokens = decoding.prefill(slot.forward, state, input_ids, prompt_mask, self._rules)
        decoding.start_decoding(state, first_tokens, prompt_lengths, self._rules)
        self.accelerator.mark_step()
        self.accelerator.synchronize()
        prefill_seconds = time.perf_counter() - started

        decode_steps = run.max_new_tokens - 1
        if slot.decode_step is None and decode_steps:
            slot.decode_step = self._decode_step_for(slot)  # timed apart, in stats.capture_seconds
            # capturing ran the step (to warm up or compile): start this batch's decoding again
            decoding.start_decoding(state, first_tokens, prompt_lengths, self._rules)
            rewind_static_cache(slot.cache, bucket_length)
            self.accelerator.mark_step()
            self.accelerator.synchronize()
        decoding_started = time.perf_counter()
        steps = decoding.decode_n_tokens(
            slot.decode_step, state, decode_steps, stop_when_finished=self._rules.stop_at_eos,
            check_every=EOS_CHECK_INTERVAL, after_step=self.accelerator.mark_step,
        )
        self.accelerator.synchronize()
        decoded = time.perf_counter()

        self.stats.batches += 1
        self.stats.new_tokens += len(prompts) * (steps + 1)
        self.stats.timings.append(BatchTiming(prefill_seconds, decoded - decoding_started, steps))
        return [self._trim(row_tokens) for row_tokens in state.new_tokens[: len(prompts)].tolist()]

    # -- internals ------------------------------------------------------------------------------

    @property
    def cache_length_in_use(self) -> int | None:
        """Positions per row of the KV cache memory this generator holds (its largest cache), None before any."""
        return self._cache_storage.capacity if self._cache_storage else None

    def _slot(self, bucket_length: int) -> DecodeSlot:
        cache_length = bucket_length + self.run.max_new_tokens
        key = (bucket_length, cache_length)
        if key not in self._slots:
            batch_size = self.run.batch_size
            if self._cache_storage is None or cache_length > self._cache_storage.capacity:
                # the slots' caches (and the graphs captured on them) live in the storage that goes: drop them first
                self._slots.clear()
                self._cache_storage = None
                check_cache_fits(self.model.config, dtype=self.run.dtype, batch_size=batch_size, cache_length=cache_length,
                                 world_size=self.world.size, device_name=self.accelerator.name,
                                 free_bytes=self.accelerator.memory_stats().get("free_bytes"))
                self._cache_storage = CacheStorage(batch_size, cache_length)
            cache = new_static_cache(self.model, cache_length, getattr(torch, self.run.dtype), self.device,
                                     self._cache_storage)
            self.accelerator.mark_step()  # on transformers 4.55 that ran a forward pass (its shape probe)
            self._slots[key] = DecodeSlot(
                cache=cache,
                state=decoding.DecodeState.allocate(batch_size, cache_length, self.run.max_new_tokens, self.device),
                forward=functools.partial(self._model_forward, cache=cache),
            )
        return self._slots[key]

    def _decode_step_for(self, slot: DecodeSlot) -> Callable[..., object]:
        """The slot's decode step, captured by the accelerator when graphs are on and capture works.

        Any failure to capture (other than running out of memory) leaves the step eager, with one warning:
        the eager step runs the very same code, so a real bug in it still surfaces there, as itself."""
        forward, rules = slot.forward, self._rules

        def decode_step(*buffers: torch.Tensor) -> torch.Tensor:
            return decoding.decode_one_token(forward, decoding.DecodeState(*buffers), rules)

        if not self.run.use_graphs or self.capture_failure is not None:
            return decode_step
        started = time.perf_counter()
        try:
            captured = self.accelerator.capture(decode_step, tuple(slot.state), self.run)
        except Exception as error:  # noqa: BLE001 - see the docstring
            if self.accelerator.is_out_of_memory(error):
                raise
            self.capture_failure = first_line(error)
            warnings.warn(
                f"the {self.accelerator.name} accelerator cannot capture the decode step of this "
                f"{self.model.config.model_type} model ({self.capture_failure}); running it eagerly: same output, "
                f"slower (pass --no-graphs to skip the attempt)",
                GraphCaptureWarning, stacklevel=2,
            )
            return decode_step
        self.stats.graph_captures += 1
        self.stats.capture_seconds += time.perf_counter() - started
        return captured

    def _trim(self, row_tokens: list[int]) -> tuple[list[int], str]:
        """The new tokens up to and including the first EOS (all of them with ignore_eos)."""
        if not self.run.ignore_eos:
            for position, token in enumerate(row_tokens):
                if token in self._eos_token_id_set:
                    return row_tokens[: position + 1], "eos"
        return row_tokens, "length"

    def _completion(self, index, prompt, prompt_token_ids, truncated, new_token_ids, finish_reason) -> Completion:
        # Decode prompt and completion together so word boundaries (e.g. SentencePiece spaces) come out right.
        prompt_text = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=True)
        full_text = self.tokenizer.decode(list(prompt_token_ids) + new_token_ids, skip_special_tokens=True)
        return Completion(
            index=index,
            prompt=prompt_text if truncated else prompt,  # what the model saw
            completion=full_text[len(prompt_text) :],
            completion_token_ids=new_token_ids,
            prompt_token_count=len(prompt_token_ids),
            finish_reason=finish_reason,
        )


def _eos_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """Every token id that ends a sequence: the generation config's, else the model config's or tokenizer's."""
    generation_config = getattr(model, "generation_config", None)
    for source in (generation_config, model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return torch.tensor(eos if isinstance(eos, list) else [eos], dtype=torch.long)
    return torch.tensor([], dtype=torch.long)
