"""This machine's cores, as this process may use them (thread counts, the private cluster's CPUs and the CPU FLOP/s
probe read it)."""

from __future__ import annotations

import math
import os
from pathlib import Path

#: Where this process's cgroup CPU controller files are (a container sees its own cgroup here), as Ray reads them.
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path | None = None) -> int | None:
    """CPUs the cgroup CPU quota allows, rounded up (``docker --cpus=2``, a Kubernetes CPU limit); ``None`` when no
    quota is set or none can be read. cgroup v2: ``cpu.max`` (``<quota> <period>`` or ``max <period>``); v1:
    ``cpu/cpu.cfs_quota_us`` over ``cpu/cpu.cfs_period_us`` (a quota of -1: none)."""
    root = CGROUP_ROOT if root is None else root
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _rounded_up(int(quota), int(period))
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return _rounded_up(quota_us, period_us)


def _rounded_up(quota: int, period: int) -> int | None:
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def local_cores() -> int:
    """CPUs this process may use: its CPU affinity (``os.cpu_count()`` where affinity is unknown), capped by its
    cgroup's CPU quota (:func:`cgroup_cpu_limit`: a container limited to 2 CPUs on a 64-core host has 2, though its
    affinity and ``os.cpu_count()`` say 64)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(cores, limit) if limit is not None else cores)
