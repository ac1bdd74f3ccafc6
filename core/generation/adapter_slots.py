"""Which LoRA adapter each buffer slot of the device holds, decided on the host (the scheduler's side of
``accelgen.model.loaded_model.AdapterBuffers``): a row starts only once its adapter holds a slot, and an adapter not
resident takes a free slot, or the slot of the least recently used adapter that no running row uses; when every slot
holds an adapter that running rows use, the row waits for one of them to end. Slot 0 is the base model's, never given.
"""

from __future__ import annotations

import collections


class AdapterSlots:
    """The adapters in ``slots`` buffer slots (1 to ``slots``), least recently used first; kept between the generator's
    calls, as the device's buffers are."""

    def __init__(self, slots: int):
        self.slots = slots
        self._held: collections.OrderedDict[str, int] = collections.OrderedDict()  # adapter -> its slot, LRU first
        self.loads = 0  # adapters copied into a slot so far

    def place(self, adapter: str | None, in_use: set[str]) -> tuple[int, bool] | None:
        """The slot of ``adapter`` (None: the base model, slot 0) and whether it must be loaded there now, marked used
        last; None when it is not resident and every slot holds one of the adapters ``in_use`` (by running rows)."""
        if adapter is None:
            return 0, False
        if adapter in self._held:
            self._held.move_to_end(adapter)
            return self._held[adapter], False
        if len(self._held) < self.slots:
            slot = min(set(range(1, self.slots + 1)) - set(self._held.values()))
        else:
            unused = next((held for held in self._held if held not in in_use), None)
            if unused is None:
                return None
            slot = self._held.pop(unused)
        self._held[adapter] = slot
        self.loads += 1
        return slot, True
