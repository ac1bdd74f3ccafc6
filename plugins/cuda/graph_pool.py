"""One memory pool shared by every live CUDA graph of an accelerator, and a fresh one once they are all gone.

Graphs captured into one pool share its memory: each decode-step graph's intermediate tensors are freed
at the end of its capture, so the next capture reuses them instead of reserving its own. That is safe
for graphs replayed one after another on one stream, as decode steps are. But PyTorch's caching
allocator refuses a capture into a pool whose graphs have all been destroyed (``INTERNAL ASSERT FAILED
... use_count > 0``, torch 2.11): the pool then only waits to be freed. Generators come and go (a
benchmark sweeps batch sizes, a program loads a second model), and their graphs with them, so the pool
must follow the graphs' lifetime rather than the accelerator's. Here each captured step is registered
with a weak reference; when none is left, the next capture starts a new pool.
"""

from __future__ import annotations

import weakref
from typing import Callable


class SharedGraphPool:
    """Hands out the pool for the next capture: the shared one while any registered graph lives, else a new one."""

    def __init__(self, new_pool: Callable[[], object]):
        self._new_pool = new_pool  # torch.cuda.graph_pool_handle on a GPU
        self._pool: object | None = None
        self._live_graphs: weakref.WeakSet = weakref.WeakSet()

    def pool_for_capture(self) -> object:
        """The pool the next capture must use."""
        if not self._live_graphs:
            self._pool = self._new_pool()
        return self._pool

    def register(self, captured: object) -> None:
        """Count ``captured`` (an object that owns one graph of this pool) among the live graphs until it is
        garbage: its graph dies with it and gives its share of the pool back."""
        self._live_graphs.add(captured)
