"""A cumulative counter read as increments (forward-pass counts that workers only ever add to)."""

from __future__ import annotations


class Increments:
    """``take(total)`` returns how much a cumulative ``total`` grew since the previous call (the first call: all of it)."""

    def __init__(self) -> None:
        self.seen = 0

    def take(self, total: int) -> int:
        since, self.seen = total - self.seen, total
        return since
