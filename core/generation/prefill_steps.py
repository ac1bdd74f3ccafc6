"""A prefill's shapes and steps, for the runner: the fixed-address buffers of one prefill shape (k prompts of a
bucket of P tokens, m rows started from them), filled for each insertion, and the steps over them: the model on the
prompts with their keys and values going into the cache rows of their slots (whole, a chunk of positions, or packed in
one row), each prompt's first token drawn.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from accelgen.generation import decoding
from accelgen.generation.sampling import RowSampling, seed_key
from accelgen.generation.scheduler import Row
from accelgen.model.transformers_adapter.forward import ModelForward
from accelgen.model.transformers_adapter.static_cache import copy_prompt_rows, packed_rows, prompt_rows


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

    def load(self, prompts: list[Row], prompt_slots: list[int], draws: list[Row], sources: list[int],
             draw_slots: list[int], pad_token_id: int) -> None:
        """The buffers filled for an insertion: its ``prompts`` (left-padded) going to the cache rows
        ``prompt_slots``, and its ``draws``, each from prompt ``sources[i]`` into slot ``draw_slots[i]``; the rows past
        them repeat the first (a padding row writes what the first writes)."""
        rows, bucket_length = self.input_ids.shape
        draw_rows = self.draw_from.shape[0]
        input_ids, prompt_mask = decoding.left_pad([row.prompt_ids for row in prompts], bucket_length, rows, pad_token_id)
        self.input_ids.copy_(input_ids)
        self.prompt_mask.copy_(prompt_mask)
        self.slots.copy_(torch.tensor(padded(prompt_slots, rows)))
        self.draw_from.copy_(torch.tensor(padded(sources, draw_rows)))
        self.draw_keys.copy_(torch.tensor(padded([row.draw_key for row in draws], draw_rows)))
        self.draw_slots.copy_(torch.tensor(padded(draw_slots, draw_rows)))
        self.adapter_slots.copy_(torch.tensor(padded([row.adapter_slot for row in prompts], rows)))
        limits, sampling = row_settings(draws)
        self.limits.copy_(torch.tensor(padded(limits, draw_rows)))
        for buffer, values in zip(self.sampling, sampling):
            buffer.copy_(torch.tensor(padded(values, draw_rows), dtype=buffer.dtype))

    def start(self, rows: int) -> decoding.RowStart:
        """What starting the first ``rows`` draws in their slots takes (after the step has run)."""
        prompts = self.draw_from[:rows]
        return decoding.RowStart(self.first_tokens[:rows], self.first_logprobs[:rows],
                                 self.prompt_mask.index_select(0, prompts), self.draw_keys[:rows],
                                 self.limits[:rows], RowSampling(*(values[:rows] for values in self.sampling)),
                                 self.adapter_slots.index_select(0, prompts))


class RowsForward:
    """The model on the cache of slots of ``cache_length`` positions, for prompts whose keys and values go into some
    of its rows; ``rows_aligned``: a model whose masks need every row at one position."""

    def __init__(self, model_forward: ModelForward, cache, cache_length: int, rows_aligned: bool):
        self.model_forward, self.cache, self.cache_length, self.rows_aligned = model_forward, cache, cache_length, rows_aligned

    def into(self, slots: torch.Tensor, start: int = 0, adapter_slots: torch.Tensor | None = None) -> decoding.Forward:
        """The model called on prompts whose keys and values go into the rows ``slots`` [k] of the cache (from
        position ``start`` on, attending to what the rows hold before it), each computed with the adapter in its buffer
        slot of ``adapter_slots`` [k] (None: the base model)."""
        on_view = functools.partial(self.model_forward, cache=prompt_rows(self.cache, slots, self.rows_aligned, start),
                                    adapter_slots=adapter_slots)
        if not self.rows_aligned:
            return on_view
        cache_length = self.cache_length

        def forward(input_ids, prompt_mask, position_ids, cache_position):
            # the model attends over whole cache rows, with a mask sized to match
            mask = torch.nn.functional.pad(prompt_mask, (0, cache_length - prompt_mask.shape[1]))
            return on_view(input_ids, mask, position_ids, cache_position)

        return forward

    def packed(self, slots: torch.Tensor, adapter_slots: torch.Tensor, input_ids: torch.Tensor, prompt_of: torch.Tensor,
               position_ids: torch.Tensor, ends: torch.Tensor, token_positions: torch.Tensor) -> torch.Tensor:
        """The model on prompts packed in one row (``decoding.PackedForward``), prompt i's keys and values into row
        ``slots[i]`` of the cache, computed with the adapter in buffer slot ``adapter_slots[i]``."""
        view = packed_rows(self.cache, slots.index_select(0, prompt_of), token_positions)
        return self.model_forward.packed_logits(input_ids, prompt_of, position_ids, ends, view, adapter_slots)


def prefill_step(prefill_shape: PrefillShape, on_rows: RowsForward, rules: decoding.TokenRules, shares_prompts: bool,
                 packed: bool = False) -> Callable[..., torch.Tensor]:
    """The prefill of one shape as a step over its buffers: the prompts' keys and values into the cache rows
    named by its ``slots``, each prompt's first token into its ``first_tokens``; ``shares_prompts``: a prompt may start
    several rows (samples), each given its prompt's keys and values; ``packed``: the prompts whole, packed in one row
    (``decoding.run_packed_prompts``)."""
    cache, start, adapter_slots = on_rows.cache, prefill_shape.first_position, prefill_shape.adapter_slots
    forward = on_rows.into(prefill_shape.slots, start, adapter_slots)

    def step(input_ids, prompt_mask, slots, draw_from, draw_keys, draw_slots, first_tokens, first_logprobs, allowed,
             *sampling):
        into_rows = functools.partial(on_rows.packed, slots, adapter_slots) if packed else None
        tokens, logprobs = decoding.prefill(forward, input_ids, prompt_mask, draw_from, draw_keys,
                                            RowSampling(*sampling), rules, start, into_rows, allowed)
        if shares_prompts:  # each sample's row of the cache gets its prompt's keys and values
            copy_prompt_rows(cache, slots.index_select(0, draw_from), draw_slots, input_ids.shape[1])
        first_logprobs.copy_(logprobs)
        return first_tokens.copy_(tokens)

    return step


def chunk_step(prefill_shape: PrefillShape, on_rows: RowsForward, start: int, end: int) -> Callable[..., torch.Tensor]:
    """The pass of positions [start, end) of a prefill shape's prompts (a chunk before its last) as a step over
    ``passes_over``: their keys and values into the cache rows named by its ``slots``."""
    forward = on_rows.into(prefill_shape.slots, start, prefill_shape.adapter_slots)

    def step(input_ids, prompt_mask, slots):
        return decoding.run_prompt_positions(forward, input_ids, prompt_mask, start, end)

    return step


def row_settings(rows: list[Row]) -> tuple[list[int], tuple[list[float], list[float], list[int]]]:
    """The rows' maximums of new tokens, and their sampling (temperatures, top-ps, seed keys), as host lists."""
    settings = [row.settings for row in rows]
    return ([own.max_new_tokens for own in settings],
            ([own.temperature for own in settings], [own.top_p for own in settings], [seed_key(own.seed) for own in settings]))


def padded(values: list[int], length: int) -> list[int]:
    """``values`` made ``length`` long by repeating the first (a padding row writes what the first writes)."""
    return values + values[:1] * (length - len(values))
