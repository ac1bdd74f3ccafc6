"""Prefix reuse: a prompt whose beginning was prefilled before gets that beginning's keys and values copied into its
cache row from the device's store of prefix blocks, and only the rest of it is prefilled.

Prompts are right-aligned in their bucket of P positions, so a prompt of n tokens holds token t at position
P - n + t: a stored block goes to that place in each row that reuses it (a token's keys and values depend on its
position among the row's real tokens, which is t in every row, not on where the row sits in the cache). The
prefill then runs only the last W positions of every prompt of the shape (a *window*, the smallest power of two
that holds each prompt's part not found in the store), attending to what the rows already hold before it; a
prompt whose part left is shorter than the window has the end of its prefix run again, writing the same values.
After the prefill, each prompt's full blocks not stored yet are copied out of its row into the store.
"""

from __future__ import annotations

import torch

from accelgen.common.errors import UsageError
from accelgen.generation.prefix_store import BLOCK_TOKENS, PrefixStore, block_keys
from accelgen.generation.scheduler import Row
from accelgen.generation.stats import GenerationStats
from accelgen.model.memory import GIB
from accelgen.model.transformers_adapter.static_cache import PrefixPool

#: The store's size when the run does not say (``--prefix-cache``): this share of the device's free memory...
DEFAULT_SHARE = 1 / 8
#: ...at most this many bytes; and this many where the device does not say what is free.
DEFAULT_MOST_BYTES, DEFAULT_UNKNOWN_BYTES = 2 << 30, 256 << 20
#: A prompt that shares at least this many blocks, not stored yet, with an earlier prompt of its insertion is
#: prefilled after it (a second, small prefill) rather than computing them again.
FOLLOW_BLOCKS = 4


def store_bytes(asked: int | None, free_bytes: int | None) -> int:
    """The bytes of the prefix store: those ``asked`` (``--prefix-cache``), else the default share of the device's
    ``free_bytes``. UsageError when more is asked than is free."""
    if asked is None:
        return DEFAULT_UNKNOWN_BYTES if free_bytes is None else min(int(free_bytes * DEFAULT_SHARE), DEFAULT_MOST_BYTES)
    if free_bytes is not None and asked > free_bytes:
        raise UsageError(f"--prefix-cache {asked / GIB:,.2f} GiB is more than the {free_bytes / GIB:,.2f} GiB free on "
                         f"the device: pass a smaller size, or 0 to turn prefix reuse off.")
    return asked


class PrefixReuse:
    """The prefix store of one runner's slots: at most ``budget_bytes`` of blocks, made on first use with the
    shapes of the cache's layers."""

    def __init__(self, budget_bytes: int, device: torch.device, stats: GenerationStats):
        self.budget_bytes, self.device, self.stats = budget_bytes, device, stats
        self.index: PrefixStore | None = None
        self.pool: PrefixPool | None = None
        self._found: list[list[int]] = []  # per prompt of the last reuse, the places of its blocks found stored

    @property
    def bytes_to_come(self) -> int:
        """Device bytes the store will take when first used (0 once it holds them)."""
        return 0 if self.pool is not None else self.budget_bytes

    def reuse(self, cache, prompts: list[Row], slots: list[int], bucket: int) -> int:
        """Copy each prompt's longest stored prefix into its slot's cache row; the window the prefill then runs (the
        whole bucket when nothing was found)."""
        if self.pool is None:
            blocks = self.budget_bytes // PrefixPool.bytes_per_block(cache, BLOCK_TOKENS)
            self.index, self.pool = PrefixStore(blocks), PrefixPool(cache, blocks, BLOCK_TOKENS)
        found = [self.index.hits(row.prompt_ids, row.settings.adapter) for row in prompts]
        self._found = found
        if not any(found):
            return bucket
        moves = [(slot, bucket - len(row.prompt_ids) + number * BLOCK_TOKENS, place)
                 for row, slot, places in zip(prompts, slots, found) for number, place in enumerate(places)]
        self._move(cache, moves, into_cache=True)
        left = max(len(row.prompt_ids) - BLOCK_TOKENS * len(places) for row, places in zip(prompts, found))
        window = BLOCK_TOKENS
        while window < left:
            window *= 2
        self.stats.prefix_hits += sum(1 for places in found if places)
        self.stats.reused_tokens += sum(BLOCK_TOKENS * len(places) for places in found)
        return min(window, bucket)

    def leaders_then_followers(self, prompts: list[Row]) -> list[set[int]]:
        """The numbers of ``prompts`` in the order their prefills should run: one set, or two when some prompts
        begin (by at least ``FOLLOW_BLOCKS`` blocks not stored yet) as an earlier prompt of the list does: those
        follow, and find that beginning stored by the time they are prefilled."""
        leading: set[int] = set()  # the block keys of the prompts prefilled first
        followers: set[int] = set()
        for row in prompts:
            keys = block_keys(row.prompt_ids, (len(row.prompt_ids) - 1) // BLOCK_TOKENS, row.settings.adapter)
            shared = sum(key in leading for key in keys)  # chained keys: those shared are a run from the first
            stored = 0 if self.index is None else self.index.stored_run(keys)
            if shared - stored >= FOLLOW_BLOCKS:
                followers.add(row.number)
            else:
                leading.update(keys)
        leaders = {row.number for row in prompts} - followers
        return [leaders, followers] if followers else [leaders]

    def store(self, cache, prompts: list[Row], slots: list[int], bucket: int) -> None:
        """Copy the prefilled prompts' full blocks that are not in the store yet out of their cache rows into it."""
        keep = {place for places in self._found for place in places}  # what this insertion's prompts found
        moves = [(slot, bucket - len(row.prompt_ids) + number * BLOCK_TOKENS, place)
                 for row, slot in zip(prompts, slots)
                 for number, place in self.index.places_for(row.prompt_ids, keep, row.settings.adapter)]
        if moves:
            self._move(cache, moves, into_cache=False)

    def _move(self, cache, moves: list[tuple[int, int, int]], into_cache: bool) -> None:
        """Copy whole blocks between (cache row, first position) and their place in the store."""
        slots, firsts, places = (torch.tensor(column, device=self.device) for column in zip(*moves))
        self.pool.move(cache, slots, firsts, places, into_cache=into_cache)
