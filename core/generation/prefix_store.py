"""Which prompt prefixes have their keys and values stored on the device, in blocks of ``BLOCK_TOKENS`` tokens:
the host side of prefix reuse (the blocks themselves are ``accelgen.model.transformers_adapter.prefix_pool``'s).

A prompt's ids are cut into full blocks from its first token; block b is named by a chain key, the hash of
block b-1's key and block b's ids, so a key names the whole prefix up to the end of its block and two prompts
share a block exactly when they share every token before its end. The chain starts from the prompt's LoRA adapter
(0 for the base model): keys and values computed with one adapter are never given to a row of another. A prompt looks up its longest run of stored
blocks from the start (``hits``); after it is prefilled, its full blocks not yet stored are given places
(``places_for``), the least recently used blocks making room. Python hashes integers and tuples the same in
every process, so the ranks of a tensor-parallel replica, which see the same rows in the same order, keep
the same index without talking.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

#: Tokens per stored block (vLLM's default block size).
BLOCK_TOKENS = 16


def block_keys(prompt_ids: Sequence[int], blocks: int, adapter: str | None = None) -> list[int]:
    """The chain keys of the first ``blocks`` full blocks of a prompt computed with the LoRA ``adapter`` (None: the base
    model)."""
    keys, key = [], adapter_key(adapter)
    for block in range(blocks):
        key = hash((key, tuple(prompt_ids[block * BLOCK_TOKENS: (block + 1) * BLOCK_TOKENS])))
        keys.append(key)
    return keys


def adapter_key(adapter: str | None) -> int:
    """Where the chain of a prompt's block keys starts: 0 for the base model, else a number made of the adapter's name
    (the same in every process, which Python's hash of a text is not)."""
    return 0 if adapter is None else int.from_bytes(hashlib.sha256(adapter.encode()).digest()[:8], "little")


class PrefixStore:
    """An index of ``capacity`` stored blocks: chain key -> place in the pool, least recently used first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._places: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))

    def hits(self, prompt_ids: Sequence[int], adapter: str | None = None) -> list[int]:
        """The places of the prompt's (of its ``adapter``) longest run of stored blocks from its first token, leaving
        at least one token to prefill (its first new token is drawn from the last prompt position's logits); marked
        used."""
        keys = block_keys(prompt_ids, (len(prompt_ids) - 1) // BLOCK_TOKENS, adapter)
        keys = keys[: self.stored_run(keys)]
        self._touch(keys)
        return [self._places[key] for key in keys]

    def stored_run(self, keys: list[int]) -> int:
        """How many of a prompt's block ``keys`` are stored, counted from its first (not marked used)."""
        run = 0
        while run < len(keys) and keys[run] in self._places:
            run += 1
        return run

    def _touch(self, keys: list[int]) -> None:
        """Mark a prompt's stored blocks used, its first block last: a block is evicted before the blocks it
        leads to, which are of no use without it."""
        for key in reversed(keys):
            if key in self._places:
                self._places.move_to_end(key)

    def places_for(self, prompt_ids: Sequence[int], keep: set[int], adapter: str | None = None) -> list[tuple[int, int]]:
        """(block number, place) for the prompt's full blocks not in the store yet, each given a place: a free one,
        else the least recently used block's, never one of ``keep`` (blocks read or written by the same insertion,
        which holds the places the prompt's stored beginning was found at) nor one of the prompt's own blocks before
        it (a block is of no use without them). Stops where no place is left."""
        keys = block_keys(prompt_ids, len(prompt_ids) // BLOCK_TOKENS, adapter)
        given = []
        for number, key in enumerate(keys):
            if key in self._places:  # stored already (found by this prompt, or stored by another of the insertion)
                keep.add(self._places[key])
                continue
            place = self._free.pop() if self._free else self._evict(keep)
            if place is None:
                break
            self._places[key] = place
            keep.add(place)
            given.append((number, place))
        self._touch(keys)
        return given

    def _evict(self, keep: set[int]) -> int | None:
        """The place of the least recently used block not in ``keep``, forgotten; None when every block is kept."""
        for key, place in self._places.items():
            if place not in keep:
                del self._places[key]
                return place
        return None
