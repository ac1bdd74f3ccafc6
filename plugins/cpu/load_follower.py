"""Threads that follow the machine's load while a run goes on, not only as it was when the run started.

torch's OpenMP threads spin at every barrier before they sleep. When another process arrives on a machine whose
cores a run's threads all hold, one of those threads waits for a core at every barrier while the others spin for
it: a small model's decode step, a few milliseconds quiet, takes ten times that or more (RESULTS-log.md, "Dataset jobs on
the user's clock"). So at the end of a step, at most every :data:`LOOK_EVERY_SECONDS`, the plugin reads what other
processes kept busy since its last look and sets torch's threads to the cores they leave idle (``choose_threads``),
never more than the run's own most (the user's ``OMP_NUM_THREADS``, else the cores it may use): fewer while the load
stays, all of them again once it has gone. A step's tokens do not depend on its threads.

Compiled steps follow too: the plugin compiles them with threads read at each call (inductor's
``cpp.dynamic_threads``) wherever a run may change its threads.
"""

from __future__ import annotations

import time
from typing import Callable

from accelgen_cpu.threads import CpuTimes, choose_threads

#: Seconds between two looks at the machine's load: long against a reading's cost (two small /proc files), short
#: against a job, so that a load that arrives costs at most this long at the slow pace.
LOOK_EVERY_SECONDS = 0.5


class LoadFollower:
    """Sets torch's threads, at most every :data:`LOOK_EVERY_SECONDS`, to what the cores other processes leave idle
    allow, between one and ``most_threads``; ``set_threads`` is torch's (a fake in tests)."""

    def __init__(self, most_threads: int, cores: int, ranks_here: int, threads: int,
                 set_threads: Callable[[int], None], read: Callable[[], CpuTimes | None] = CpuTimes.now,
                 clock: Callable[[], float] = time.monotonic):
        self.most_threads, self.cores, self.ranks_here = most_threads, cores, ranks_here
        self.threads = threads  # torch's threads now
        self.fewest = most_threads  # the fewest it has set (the start's own count is said by the thread choice)
        self.looks = self.looks_with_fewer = 0  # looks made; of them, those after which it ran with fewer than its most
        self._set_threads, self._read, self._clock = set_threads, read, clock
        self._last = read()
        self._next_look = clock() + LOOK_EVERY_SECONDS

    def after_step(self) -> None:
        """Called after each step: a look at the machine when one is due, and torch's threads changed if the load
        asks for another count."""
        now = self._clock()
        if now < self._next_look:
            return
        self._next_look = now + LOOK_EVERY_SECONDS
        reading = self._read()
        if reading is None or self._last is None:  # /proc unreadable: nothing to follow
            return
        busy = reading.busy_elsewhere_since(self._last, self.ranks_here)
        self._last = reading
        threads = min(self.most_threads, choose_threads(self.cores, busy, self.ranks_here))
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
            self.fewest = min(self.fewest, threads)
        self.looks += 1
        self.looks_with_fewer += threads < self.most_threads

    def describe(self) -> str | None:
        """The phrase the summary adds when the run went below its most threads, e.g. ``1 thread while other
        processes kept cores busy (40% of the run)``; None when it never did."""
        if self.fewest >= self.most_threads or not self.looks:
            return None
        share = 100 * self.looks_with_fewer / self.looks
        return (f"{self.fewest} thread{'' if self.fewest == 1 else 's'} while other processes kept cores busy "
                f"({share:.0f}% of the run)")
