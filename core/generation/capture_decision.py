"""When a job whose length decides its capture captures its decode step: once the rows it has finished say that the
steps left will pay for it.

A device whose capture costs much (a compiler on the CPU: seconds to a minute) captures only a job of enough decode
steps (``Accelerator.capture_pays_after``). Before the job, only the most it can take is known: every row its whole
``--max-new-tokens``. Rows that end early (end-of-sequence, a stop text) take far fewer, and a job counted by its
most would pay for a compile it never earns back. So a job that may be long enough starts eagerly, and at each look
the rows finished so far give the mean steps a row takes; the step is captured as soon as the rows left, at that
mean, take enough steps to pay for it. The first rows to end are the shortest of the first slots' rows, so no
estimate is made before twice the slots' rows have ended.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CaptureWhenItPays:
    """The deferred decision of one run: ``rows`` (its rows' samples) through ``slots`` slots; capturing pays after
    ``pays_after_steps`` decode steps."""

    pays_after_steps: int
    rows: int
    slots: int

    def pays_now(self, rows_ended: int, steps_of_ended_rows: int) -> bool:
        """Whether to capture now, ``rows_ended`` rows having ended after ``steps_of_ended_rows`` decode steps in all."""
        if rows_ended < min(2 * self.slots, self.rows) or rows_ended >= self.rows:
            return False
        steps_left = (self.rows - rows_ended) * steps_of_ended_rows / rows_ended / self.slots
        return steps_left >= self.pays_after_steps
