"""Python's cyclic garbage collector in a process of accelgen's own (the ``accelgen`` script, a launched rank): the
objects its start builds (torch's, transformers' and the datasets library's modules, the model's: several hundred
thousand, alive until the process ends) are kept out of the collector's traversals.

CPython's collector counts allocations: every 700 it collects the youngest generation, and now and then every
generation, traversing each object it tracks. A start that imports torch and transformers makes full collections over a
growing heap, and the interpreter's collections at exit traverse all of it once more: together about a fifth of a short
job (benchmarks/RESULTS-log.md, "The collector at a job's start and end"). So, in such a process:

- while the command starts, the youngest generation is collected every :data:`START_UP_ALLOCATIONS` allocations instead
  of 700: fewer traversals, and a cycle made while loading is still freed;
- once the model is loaded (:func:`start_up_ended`), what the start built is frozen (``gc.freeze``: left out of every
  later collection; it lives until the process ends anyway) and the thresholds are put back, so that the garbage of
  the generation is collected as usual;
- when the command ends, every object is frozen, so that the interpreter's collections at exit traverse nothing; exit
  handlers and finalizers run as usual.

``accelgen.cli.main`` called from Python (a test, a program) leaves the collector as it is: freezing there would keep the
caller's garbage for the life of its process.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

#: Allocations between two collections of the youngest generation while a command starts (CPython's default: 700).
START_UP_ALLOCATIONS = 100_000

_thresholds_before_start: tuple[int, ...] | None = None  # set while a command process starts


@contextlib.contextmanager
def command_process() -> Iterator[None]:
    """Around the whole command of a process of accelgen's own: the collector as the module's text says."""
    global _thresholds_before_start
    _thresholds_before_start = gc.get_threshold()
    gc.set_threshold(START_UP_ALLOCATIONS, *_thresholds_before_start[1:])
    try:
        yield
    finally:
        start_up_ended()
        gc.freeze()  # the interpreter's last collections have nothing left to traverse


def start_up_ended() -> None:
    """The model is loaded: what the start built is frozen, and the collector collects as usual from here. Outside
    :func:`command_process` (and once its start has ended), nothing."""
    global _thresholds_before_start
    if _thresholds_before_start is not None:
        gc.freeze()
        gc.set_threshold(*_thresholds_before_start)
        _thresholds_before_start = None
