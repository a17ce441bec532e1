"""Splitting a list over workers: the one rule the rollouts, the environment steps and generation share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def contiguous_shards(items: Sequence[T], num_shards: int) -> list[Sequence[T]]:
    """Split ``items`` into at most ``num_shards`` contiguous, non-empty pieces of ``ceil(len / num_shards)`` items
    (the last may be shorter), in order; ``[]`` for no items. Piece ``r`` goes to worker ``r``: with fewer items
    than workers, the last workers get none."""
    if not items:
        return []
    per = -(-len(items) // num_shards)
    return [items[i : i + per] for i in range(0, len(items), per)]
