"""Items cut into consecutive groups of a bounded total size: weights written a file at a time, prompts prefilled a
bounded number of tokens at a time."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def consecutive_groups(items: list[T], size_of: Callable[[T], int], most: int) -> list[list[T]]:
    """``items`` in order, cut into consecutive groups whose sizes (``size_of``) add up to at most ``most`` (an item
    larger than that gets a group of its own)."""
    groups: list[list[T]] = [[]]
    total = 0
    for item in items:
        size = size_of(item)
        if groups[-1] and total + size > most:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += size
    return [group for group in groups if group]
