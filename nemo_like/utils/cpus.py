"""This machine's cores, as this process may use them (thread counts and the CPU FLOP/s probe read it)."""

from __future__ import annotations

import os


def local_cores() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` where affinity is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
