"""The generation pipeline: tokenize, pad to a bucket, prefill a static cache, replay one captured step.

One ``Generator`` holds a prepared model on one accelerator. For each static shape (bucket length,
cache length) it keeps a ``DecodeSlot``: the KV cache and the fixed-address buffers the captured
decode step reads, so a second batch of the same bucket reuses the graph without capturing again.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Iterable, Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from accelgen import decoding
from accelgen.errors import UsageError
from accelgen.hookspecs import Accelerator
from accelgen.kv_cache import new_static_cache, rewind_static_cache
from accelgen.models import context_limit, forward_accepts
from accelgen.settings import RunSettings, World

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
    batches: int = 0
    new_tokens: int = 0
    timings: list[BatchTiming] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class DecodeSlot:
    """Static buffers for one shape. Shapes: B batch, L cache length."""

    cache: object  # transformers StaticCache sized [B, heads, L, head_dim] per layer
    input_ids: torch.Tensor  # [B, 1] the token being decoded
    position_ids: torch.Tensor  # [B, 1] its position, counting real tokens only
    cache_position: torch.Tensor  # [1] where its keys and values are written
    attention_mask: torch.Tensor  # [B, L] 1 where a row may attend
    decode_step: object = None  # the captured (or plain) step, set after the first prefill


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
    ):
        self.model, self.tokenizer, self.accelerator = model, tokenizer, accelerator
        self.device, self.run, self.world = device, run, world
        self.stats = GenerationStats()
        self.last_bucket_length: int | None = None  # prompt bucket of the latest batch, for memory advice
        self.unsharded_parameter_bytes = unsharded_parameter_bytes  # the model before sharding, for reports
        self._slots: dict[tuple[int, int], DecodeSlot] = {}
        self._takes_position_ids = forward_accepts(model, "position_ids")
        self._takes_logits_to_keep = forward_accepts(model, "logits_to_keep")
        self._context_limit = context_limit(model.config)
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_ids = _eos_token_ids(model, tokenizer).to(device)
        self._sampler = torch.Generator(device=device) if run.sampling.do_sample else None

    # -- public ---------------------------------------------------------------------------------

    def with_batch_size(self, batch_size: int) -> "Generator":
        """A generator sharing this one's model for another fixed batch size (its own caches and graphs)."""
        return Generator(
            self.model, self.tokenizer, self.accelerator, self.device, dataclasses.replace(self.run, batch_size=batch_size),
            self.world, self.unsharded_parameter_bytes,
        )

    def generate(self, prompts: Sequence[str]) -> list[Completion]:
        """Completions for ``prompts``, in order."""
        return [completion for batch in self.generate_batches(prompts) for completion in batch]

    def generate_batches(self, prompts: Iterable[str], first_index: int = 0) -> Iterator[list[Completion]]:
        """Completions batch by batch (``run.batch_size`` prompts each), so callers can write as they go.

        ``prompts`` may be any iterable (a streamed dataset): it is read one batch at a time.
        ``first_index`` numbers the prompts (and seeds sampling per batch, so a resumed run draws the same)."""
        remaining = iter(prompts)
        index = first_index
        while batch := list(itertools.islice(remaining, self.run.batch_size)):
            token_ids, truncated = self.tokenize(batch, first_index=index)
            outputs = self.generate_token_ids(token_ids, seed_offset=index)
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
        token_ids = self.tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
        limit = self.run.max_input_tokens
        truncated = [limit is not None and len(ids) > limit for ids in token_ids]
        token_ids = [ids[:limit] for ids in token_ids] if limit is not None else token_ids
        vocab_size = self.model.config.vocab_size
        for index, ids in enumerate(token_ids, start=first_index):
            if not ids:
                raise UsageError(f"Prompt {index} is empty: give it some text (or drop that row from the dataset).")
            if max(ids) >= vocab_size:
                raise UsageError(
                    f"Prompt {index} has token id {max(ids)}, outside the model's vocabulary of {vocab_size}: "
                    f"the tokenizer does not belong to this model."
                )
        return token_ids, truncated

    @torch.no_grad()
    def generate_token_ids(
        self, prompts: Sequence[Sequence[int]], seed_offset: int = 0
    ) -> list[tuple[list[int], str]]:
        """New token ids and finish reason per prompt, for at most ``run.batch_size`` tokenized prompts."""
        run = self.run
        if not 0 < len(prompts) <= run.batch_size:
            raise ValueError(f"expected 1 to {run.batch_size} prompts, got {len(prompts)}")
        bucket_length = decoding.choose_bucket(
            max(len(ids) for ids in prompts), run.buckets, self._context_limit, run.max_new_tokens
        )
        self.last_bucket_length = bucket_length
        input_ids, prompt_mask = decoding.left_pad(prompts, bucket_length, run.batch_size, self.pad_token_id)
        slot = self._slot(bucket_length)
        slot.cache.reset()
        slot.attention_mask.zero_()
        slot.attention_mask[:, :bucket_length].copy_(prompt_mask)
        if self._sampler is not None:
            self._sampler.manual_seed(run.sampling.seed * 1_000_003 + seed_offset)

        self.accelerator.synchronize()
        started = time.perf_counter()
        logits = self._forward(
            input_ids.to(self.device),
            slot.attention_mask,
            decoding.positions_from_mask(prompt_mask).to(self.device),
            torch.arange(bucket_length, device=self.device),
            slot.cache,
        )
        next_tokens = decoding.sample(logits, run.sampling, self._sampler)
        self.accelerator.mark_step()
        self.accelerator.synchronize()
        prefilled = time.perf_counter()

        new_tokens = torch.full((run.batch_size, run.max_new_tokens), self.pad_token_id, device=self.device)
        new_tokens[:, 0] = next_tokens
        finished = torch.isin(next_tokens, self.eos_token_ids)
        slot.input_ids.copy_(next_tokens.unsqueeze(-1))
        slot.position_ids.copy_(prompt_mask.sum(-1, keepdim=True))
        slot.cache_position.fill_(bucket_length)
        if slot.decode_step is None:
            self._set_decode_step(slot, bucket_length)

        steps = 0
        for step in range(1, run.max_new_tokens):
            if not run.ignore_eos and step % EOS_CHECK_INTERVAL == 0 and bool(finished.all()):
                break
            next_tokens = decoding.decode_one_token(
                slot.decode_step, slot.input_ids, slot.position_ids, slot.cache_position, slot.attention_mask,
                run.sampling, self._sampler,
            )
            if not run.ignore_eos:
                next_tokens = next_tokens.masked_fill(finished, self.pad_token_id)
                finished |= torch.isin(next_tokens, self.eos_token_ids)
            new_tokens[:, step] = next_tokens
            decoding.advance(slot.input_ids, slot.position_ids, slot.cache_position, next_tokens)
            self.accelerator.mark_step()
            steps += 1
        self.accelerator.synchronize()
        decoded = time.perf_counter()

        self.stats.batches += 1
        self.stats.new_tokens += len(prompts) * (steps + 1)
        self.stats.timings.append(BatchTiming(prefilled - started, decoded - prefilled, steps))
        return [self._trim(row_tokens) for row_tokens in new_tokens[: len(prompts)].tolist()]

    # -- internals ------------------------------------------------------------------------------

    def _forward(self, input_ids, attention_mask, position_ids, cache_position, cache) -> torch.Tensor:
        """Logits [B, V] of the last position. input_ids, position_ids: [B, T]; attention_mask: [B, L]."""
        arguments = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            cache_position=cache_position,
            use_cache=True,
        )
        if self._takes_position_ids:
            arguments["position_ids"] = position_ids
        if self._takes_logits_to_keep:
            arguments["logits_to_keep"] = 1
        return self.model(**arguments).logits[:, -1, :]

    def _slot(self, bucket_length: int) -> DecodeSlot:
        cache_length = bucket_length + self.run.max_new_tokens
        key = (bucket_length, cache_length)
        if key not in self._slots:
            batch_size, device = self.run.batch_size, self.device
            self._slots[key] = DecodeSlot(
                cache=new_static_cache(self.model, batch_size, cache_length, device, getattr(torch, self.run.dtype)),
                input_ids=torch.zeros((batch_size, 1), dtype=torch.long, device=device),
                position_ids=torch.zeros((batch_size, 1), dtype=torch.long, device=device),
                cache_position=torch.zeros((1,), dtype=torch.long, device=device),
                attention_mask=torch.zeros((batch_size, cache_length), dtype=torch.long, device=device),
            )
        return self._slots[key]

    def _set_decode_step(self, slot: DecodeSlot, bucket_length: int) -> None:
        """Give the slot its decode step, captured by the accelerator when graphs are on."""

        def decode_step(input_ids, position_ids, cache_position, attention_mask):
            return self._forward(input_ids, attention_mask, position_ids, cache_position, slot.cache)

        if not self.run.use_graphs:
            slot.decode_step = decode_step
            return
        slot.attention_mask.index_fill_(1, slot.cache_position, 1)  # valid example inputs for a warm-up
        example_inputs = (slot.input_ids, slot.position_ids, slot.cache_position, slot.attention_mask)
        slot.decode_step = self.accelerator.capture(decode_step, example_inputs, self.run)
        rewind_static_cache(slot.cache, bucket_length)
        self.stats.graph_captures += 1

    def _trim(self, row_tokens: list[int]) -> tuple[list[int], str]:
        """The new tokens up to and including the first EOS (all of them with ignore_eos)."""
        if not self.run.ignore_eos:
            eos_ids = set(self.eos_token_ids.tolist())
            for position, token in enumerate(row_tokens):
                if token in eos_ids:
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
