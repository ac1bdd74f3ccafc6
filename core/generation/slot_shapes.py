"""The slots' shapes: the KV cache's memory (one :class:`~accelgen.model.transformers_adapter.static_cache.CacheStorage`,
checked against the device's free memory before it grows) and, for each cache length the slots are made for (a prompt
bucket plus the new tokens), a :class:`SlotShape`: the cache, the decode step's buffers
(:class:`~accelgen.generation.decoding.DecodeState`) and the decode step, captured by the accelerator before any row is
in it, or later, while rows run, for a run found long enough (:meth:`SlotShapes.capture_now`). :class:`StepCapture`
captures a step (the decode step, or a prefill shape's) and counts it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Callable

import torch

from accelgen.common.errors import GraphCaptureWarning, first_line, interruption_in
from accelgen.common.settings import RunSettings, World
from accelgen.generation import decoding
from accelgen.generation.constraints import SlotConstraints
from accelgen.generation.prefill_steps import PrefillShape, RowsForward
from accelgen.generation.prefix_reuse import PrefixReuse
from accelgen.generation.stats import GenerationStats
from accelgen.model.memory import check_cache_fits
from accelgen.model.transformers_adapter.forward import ModelForward
from accelgen.model.transformers_adapter.static_cache import (
    CacheStorage,
    each_row_write,
    needs_first_write,
    new_static_cache,
    write_each_row_at,
)
from accelgen.plugin.contract import Accelerator


class StepCapture:
    """Steps captured by the accelerator over their buffers when ``run.use_graphs`` and capture works (each capture
    counted in ``stats``); else decode steps as the accelerator traces them, when ``run.trace_steps`` and tracing
    works; else the steps themselves."""

    def __init__(self, accelerator: Accelerator, run: RunSettings, stats: GenerationStats, model_type: str):
        self.accelerator, self.run, self.stats, self.model_type = accelerator, run, stats, model_type
        self.failure: str | None = None  # why the accelerator could not capture (then steps run eagerly)

    @property
    def captures(self) -> bool:
        """Whether steps are captured now (the run's choice; a run found long enough turns it on)."""
        return bool(self.run.use_graphs)

    def turn_on(self) -> None:
        """Capture from here on (a run that started eagerly, found long enough for it)."""
        self.run = dataclasses.replace(self.run, use_graphs=True)

    def __call__(self, step: Callable[..., torch.Tensor], buffers: tuple[torch.Tensor, ...], counter: str) -> Callable:
        """``step`` captured over ``buffers``, counted in ``stats.<counter>``; or ``step`` itself. Any failure to
        capture other than running out of memory leaves steps eager, with one warning: the eager step runs the very
        same code, so a real bug in it still surfaces there, as itself. A Ctrl-C or a stop signal that the compiler
        wrapped in its own error goes on as itself."""
        if counter == "prefill_captures" and not self.accelerator.tuning.captures_prefill:
            return step
        if not self.captures or self.failure is not None:
            return self._traced(step, buffers) if counter == "graph_captures" else step
        started = time.perf_counter()
        try:
            captured = self.accelerator.capture(step, buffers, self.run)
        except Exception as error:  # noqa: BLE001 - see the docstring
            self._raise_if_it_goes_on(error)
            self.failure = first_line(error)
            warnings.warn(
                f"the {self.accelerator.name} accelerator cannot capture the decode step of this {self.model_type} "
                f"model ({self.failure}); running it eagerly: same output, slower (pass --no-graphs to skip the "
                f"attempt)",
                GraphCaptureWarning, stacklevel=3,
            )
            return step
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        self.stats.capture_seconds += time.perf_counter() - started
        return captured

    def _traced(self, step: Callable[..., torch.Tensor], buffers: tuple[torch.Tensor, ...]) -> Callable:
        """The decode step as the accelerator traces it over ``buffers``, or ``step`` itself: where the run does not
        trace, or the accelerator could not (the reason kept, no more tries). Tracing costs next to nothing: no
        warning says a step runs as it is (same output; the run record keeps why). Running out of memory, Ctrl-C and
        stop signals go on as themselves, as for a capture."""
        if not self.run.trace_steps or self.stats.trace_failure is not None:
            return step
        started = time.perf_counter()
        try:
            traced = self.accelerator.trace_step(step, buffers, self.run)
        except Exception as error:  # noqa: BLE001 - see the docstring
            self._raise_if_it_goes_on(error)
            self.stats.trace_failure = first_line(error)
            return step
        if traced is not step:
            self.stats.step_traces += 1
            self.stats.capture_seconds += time.perf_counter() - started
        return traced

    def _raise_if_it_goes_on(self, error: Exception) -> None:
        """Raise what a failed capture or trace must not hide: running out of memory, and Ctrl-C or a stop signal that
        the compiler or tracer wrapped in its own error (as itself)."""
        if self.accelerator.is_out_of_memory(error):
            raise error
        if (interruption := interruption_in(error)) is not None:
            raise interruption from None


class DecodeStep(torch.nn.Module):
    """A slot shape's decode step (``step``, called with the shape's buffers) as a module that holds what the step reads
    and writes besides its buffers: the model (its weights) and the shape's cache (each layer's keys and values, as
    buffers). A device that traces the step (``Accelerator.trace_step``) then finds them as the module's own state, freed
    with it: a tensor a trace finds anywhere else becomes a constant of its graph, which torch keeps until the process
    ends (pytorch/pytorch#43119), and a cache the slots replaced by a larger one would stay with it."""

    def __init__(self, model: torch.nn.Module, cache, step: Callable[..., torch.Tensor]):
        super().__init__()
        self.model = model
        for index in range(len(getattr(cache, "layers", ()))):
            written = each_row_write(cache, index)  # None for a layer that has not taken its memory yet
            if written is not None:
                self.register_buffer(f"keys_{index}", written[0], persistent=False)
                self.register_buffer(f"values_{index}", written[1], persistent=False)
        self._step = step

    def forward(self, *buffers: torch.Tensor) -> torch.Tensor:
        return self._step(*buffers)


class SlotShape:
    """Everything the slots need for one cache length, kept while the storage it views lives."""

    def __init__(self, cache, state: decoding.DecodeState, forward: decoding.Forward):
        self.cache = cache  # [B, heads, L, head_dim] per layer
        self.state = state
        self.forward = forward  # the model on this cache
        self.decode_step: Callable[..., object] | None = None  # decode_step(*state): captured, or plain
        self.prefill_shapes: dict[tuple[int, int], PrefillShape] = {}


@dataclasses.dataclass(eq=False)
class SlotShapes:
    """The shapes of ``run.batch_size`` slots of ``forward``'s model, their caches in one storage; ``current``, the one
    in use. ``prefixes``: the store of prompt prefixes, whose memory to come the cache's check counts."""

    forward: ModelForward
    accelerator: Accelerator
    device: torch.device
    run: RunSettings
    world: World
    rules: decoding.TokenRules
    capture: StepCapture
    constraints: SlotConstraints | None
    rows_aligned: bool  # a model whose masks need every row at one position
    prefixes: PrefixReuse | None
    current: SlotShape | None = None
    _storage: CacheStorage | None = None
    _shapes: dict[int, SlotShape] = dataclasses.field(default_factory=dict)  # by cache length

    @property
    def cache_length_in_use(self) -> int | None:
        """Positions per row of the KV cache memory held (its largest cache), None before any."""
        return self._storage.capacity if self._storage else None

    @property
    def mask_words(self) -> int:
        """Words of 32 tokens in a row of the slots' masks of allowed tokens (0: the run holds no row to a structure)."""
        return 0 if self.constraints is None else self.constraints.mask.shape[1]

    def use(self, cache_length: int) -> SlotShape:
        """The shape of ``cache_length`` positions per row, made the current one (only called while no slot holds a
        row): kept from before, or made (with a larger storage first where the cache needs one)."""
        if self.current is not None and self.current.state.attention_mask.shape[1] == cache_length:
            return self.current
        self._make_room_for(cache_length)
        if cache_length not in self._shapes:
            self._shapes[cache_length] = self._new_shape(cache_length)
        self.current = self._shapes[cache_length]
        return self.current

    def capture_now(self) -> None:
        """Capture the decode step from here on: the current shape's now, over its buffers with their rows in them,
        the other shapes' when next made. A capture may run the step (warm-ups, a compiler's first call): the buffers
        it ran on are put back as they were, and what it wrote into the cache is what the next step writes there (the
        same tokens at the same positions; draws are a function of the buffers, and keys and values past a row's
        position are written before they are read)."""
        self.capture.turn_on()
        self._shapes = {length: shape for length, shape in self._shapes.items() if shape is self.current}
        if self.current is None:
            return
        as_they_were = [buffer.clone() for buffer in self.current.state]
        self._make_decode_step(self.current)
        for buffer, kept in zip(self.current.state, as_they_were):
            buffer.copy_(kept)
        self.accelerator.mark_step()

    def _new_shape(self, cache_length: int) -> SlotShape:
        """The cache, buffers and forward of slots with ``cache_length`` positions per row."""
        run = self.run
        cache = new_static_cache(self.forward.model, cache_length, run.torch_dtype, self.device, self._storage)
        self.accelerator.mark_step()  # on transformers 4.55 that ran a forward pass (its shape probe)
        state = decoding.DecodeState.allocate(run.batch_size, cache_length, run.max_new_tokens, self.device,
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
            RowsForward(self.forward, cache, cache_length, self.rows_aligned).into(first)(
                one * self.rules.pad_token_id, one, one * 0, first)
            self.accelerator.mark_step()
        self._make_decode_step(shape)
        return shape

    def _make_decode_step(self, shape: SlotShape) -> None:
        """The shape's decode step, captured (before any row is in it, where a warm-up run harms nothing; or by
        :meth:`capture_now`), or plain; none when no row takes a decode step."""
        if self.run.max_new_tokens <= 1:
            return
        forward, rules, rows_aligned = shape.forward, self.rules, self.rows_aligned

        def decode_step(*buffers: torch.Tensor) -> torch.Tensor:
            state = decoding.DecodeState(*buffers)
            on_rows_adapters = functools.partial(forward, adapter_slots=state.adapter_slots)
            return decoding.decode_one_token(on_rows_adapters, state, rules, rows_aligned)

        step = DecodeStep(self.forward.model, shape.cache, decode_step)
        shape.decode_step = self.capture(step, tuple(shape.state), "graph_captures")

    def _make_room_for(self, cache_length: int) -> None:
        """A cache storage of at least ``cache_length`` positions, checked against the device's free memory. A
        larger one replaces the old, and the shapes whose caches (and graphs) lived in the old one go first."""
        if self._storage is not None and cache_length <= self._storage.capacity:
            return
        self._shapes.clear()
        self.current = self._storage = None
        run = self.run
        check_cache_fits(self.forward.model.config, dtype=run.dtype, batch_size=run.batch_size,
                         cache_length=cache_length, world_size=self.world.size, device_name=self.accelerator.name,
                         free_bytes=self.accelerator.memory_stats().get("free_bytes"),
                         device_is_host=self.accelerator.shares_host_memory,
                         prefix_store_bytes=0 if self.prefixes is None else self.prefixes.bytes_to_come,
                         prefill_chunk=run.prefill_chunk)
        self._storage = CacheStorage(run.batch_size, cache_length)
