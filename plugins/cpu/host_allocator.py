"""How a CPU process's freed memory is kept for its next pass: glibc's malloc told to reuse it, not to hand it back.

torch's CPU tensors come from the C library's ``malloc``. glibc maps a large block fresh from the kernel (``mmap``)
and returns it when freed, and gives the top of its heap back once more than a threshold of it is free (twice the
largest block freed so far, 64 MiB at most). A prefill pass of varying shape frees tens of MiB of temporaries
(attention, logits) at a time, so each pass pays the kernel again for every page of them (a scoring job's page faults:
RESULTS-log.md, "Scoring"). Once a model is ready, blocks up to ``MAPPED_FROM`` come from the heap, and up to
``KEPT_FREE`` of it stays with the process after a pass for the next; the process's peak memory is what it was (the
same blocks, at the same time). While a model loads, freed memory goes back at once (glibc's first settings, held
fixed): a load frees blocks of many sizes once each, which kept memory would seldom serve again, so its peak would
grow with them. A value the user set (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) is theirs; another C
library (musl, macOS) or a preloaded allocator keeps its own ways.
"""

from __future__ import annotations

import ctypes
import os
import platform

#: Blocks of this size or more are mapped on their own (glibc's largest: half its heap's largest size).
MAPPED_FROM = 32 << 20
#: Free memory at the heap's top that stays with the process.
KEPT_FREE = 256 << 20
#: glibc's first threshold of both (a block mapped on its own; free memory at the heap's top given back).
GLIBC_FIRST = 128 << 10
#: glibc's ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_USERS_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed blocks for the process's next pass (a model is ready); whether it now does."""
    return _set_malloc(MAPPED_FROM, KEPT_FREE)


def return_freed_memory() -> bool:
    """Tell glibc's malloc to give freed memory back at once (a model loads); whether it now does."""
    return _set_malloc(GLIBC_FIRST, GLIBC_FIRST)


def _set_malloc(mapped_from: int, kept_free: int) -> bool:
    if not is_ours_to_set(os.environ):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mapped_from)) and bool(mallopt(_M_TRIM_THRESHOLD, kept_free))


def is_ours_to_set(environment) -> bool:
    """Whether a process started with ``environment`` on this machine gets its malloc set by the plugin: glibc's, with
    no setting of the user's and no allocator preloaded."""
    if platform.system() != "Linux" or not _glibc():
        return False
    return not any(name in environment for name in (*_USERS_SETTINGS, "LD_PRELOAD"))


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):  # a C library that does not know the name
        return False
