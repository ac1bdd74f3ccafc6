"""What a run's LoRA adapters did, for its summary line and result files."""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

from accelgen.common.settings import AdapterSettings


class AdapterCounts(Protocol):
    """A generator's counts (``accelgen.generation.stats.GenerationStats``), or a replica's report of them."""

    adapter_loads: int
    adapter_rows: dict[str, int]


@dataclasses.dataclass(frozen=True)
class AdapterFigures:
    """``named`` adapters held ``slots`` at a time in ``buffer_bytes`` of device memory per rank, copied into a slot
    ``loads`` times as their rows arrived, and the prompts completed with each (``rows``; "" the base model's); or the
    one ``merged`` into the weights (its path)."""

    named: tuple[str, ...] = ()
    slots: int = 0
    buffer_bytes: int = 0
    loads: int = 0
    rows: dict[str, int] = dataclasses.field(default_factory=dict)
    merged: str | None = None

    @classmethod
    def of(cls, settings: AdapterSettings, buffer_bytes: int, counts: Sequence[AdapterCounts]) -> "AdapterFigures | None":
        """The figures of a run with the adapters of ``settings``, summed over ``counts`` (one per replica); None
        without adapters."""
        if not settings.named and settings.merged is None:
            return None
        rows: dict[str, int] = {}
        for count in counts:
            for name, number in count.adapter_rows.items():
                rows[name] = rows.get(name, 0) + number
        return cls(settings.names, settings.max_loras, buffer_bytes, sum(count.adapter_loads for count in counts),
                   dict(sorted(rows.items())), settings.merged)

    def describe(self) -> str:
        """The figures as a clause of the summary line."""
        if self.merged is not None:
            return f"LoRA adapter {self.merged} merged into the weights"
        rows = ", ".join(f"{name or 'base'} {number:,}" for name, number in self.rows.items()) or "none"
        return (f"LoRA: {len(self.named)} adapter{'' if len(self.named) == 1 else 's'} in {self.slots} buffer slot"
                f"{'' if self.slots == 1 else 's'} ({self.buffer_bytes / 2**20:,.1f} MiB per rank), {self.loads:,} "
                f"load{'' if self.loads == 1 else 's'}; rows: {rows}")
