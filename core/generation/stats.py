"""What a generator did, counted the same way whatever the batching."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class BatchTiming:
    """Device-synchronised timings of one call of the generator (all the rows it was given)."""

    prefill_seconds: float  # prefill forward passes, first tokens and insertions into slots
    decode_seconds: float  # decode steps, and the looks at which rows have finished
    decode_steps: int  # decode steps taken

    @property
    def seconds_per_decode_step(self) -> float:
        return self.decode_seconds / max(self.decode_steps, 1)


@dataclasses.dataclass
class GenerationStats:
    graph_captures: int = 0  # decode steps captured (one per cache length the slots were made for)
    prefill_captures: int = 0  # prefill steps captured (one per prefill shape: row count and bucket)
    capture_seconds: float = 0.0  # spent capturing (compiling, where the device compiles), not in any timing
    step_traces: int = 0  # decode steps traced instead of captured (``Accelerator.trace_step``), in capture_seconds
    trace_failure: str | None = None  # why the accelerator could not trace the decode step (then it ran as it is)
    batches: int = 0  # times rows were given out (a fixed batch; continuous: the rows ready at one look)
    prefills: int = 0  # prefills run (each inserts one or more rows into free slots)
    prefill_passes: int = 0  # their forward passes: one each, or one per chunk (--prefill-chunk)
    prefill_rows: int = 0  # rows of the prefill shapes run, padding rows included
    decode_steps: int = 0  # decode steps taken
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    new_tokens: int = 0  # tokens given out: each row's new tokens up to its end
    slot_tokens: int = 0  # token places computed: rows of every prefill shape and every slot of every step
    prompt_tokens: int = 0  # tokens of the prompts prefilled (a prompt's samples share its prefill)
    prefilled_tokens: int = 0  # of those, run through the model (a prefill window may run some reused ones again)
    reused_tokens: int = 0  # of those, copied from the prefix store instead of being computed
    prefill_positions: int = 0  # token places prefill passes computed: rows x positions, padding included
    prefix_hits: int = 0  # prompts that found their beginning in the prefix store
    prefix_store_bytes: int | None = None  # the size of that store (--prefix-cache); None when prefixes are not reused
    #: the longest wait of running rows between two decode steps, and the longest prefill forward pass: host clock
    #: seconds (on a device that runs steps as they are issued, the CPU, the time they took)
    longest_decode_gap: float = 0.0
    longest_prefill_pass: float = 0.0
    longest_wait_positions: int = 0  # the most prompt positions prefilled while running rows waited for a decode step
    constrained_rows: int = 0  # rows started with a structure (each sample a row)
    grammar_compile_seconds: float = 0.0  # compiling their structures' grammars (once per distinct structure)
    mask_seconds: float = 0.0  # the host's work of following their tokens and filling the masks of the next steps
    adapter_loads: int = 0  # LoRA adapters copied into a buffer slot as their rows arrived
    adapter_rows: dict[str, int] = dataclasses.field(default_factory=dict)  # rows given out per adapter ("" : the base)
    timings: list[BatchTiming] = dataclasses.field(default_factory=list)  # one per call

    @property
    def mask_share(self) -> float | None:
        """The host's mask work over the time of the decode steps (None when no row had a structure)."""
        return self.mask_seconds / self.decode_seconds if self.constrained_rows and self.decode_seconds else None

    @property
    def slot_occupancy(self) -> float | None:
        """The share of computed token places that produced a kept token."""
        return self.new_tokens / self.slot_tokens if self.slot_tokens else None
