"""This machine's cores, as this process may use them (thread counts, the private cluster's CPUs and the CPU FLOP/s
probe read it)."""

from __future__ import annotations

import math
import os
from pathlib import Path

#: Where the cgroup hierarchy is mounted (a container with a cgroup namespace of its own sees its cgroup at the top), and
#: which cgroup this process is in, below it (without such a namespace, ``systemd-run -p CPUQuota=``, a batch job's
#: scope or ``docker --cgroupns=host``, its quota is set on that cgroup, not at the top).
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
CPUINFO = Path("/proc/cpuinfo")


def cgroup_cpu_limit(root: Path | None = None) -> int | None:
    """CPUs the cgroup CPU quota allows, rounded up (``docker --cpus=2``, a Kubernetes CPU limit, a systemd or batch
    scope's CPU quota); ``None`` when no quota is set or none can be read. The smallest quota on the way from this
    process's own cgroup up to the top: cgroup v2: ``cpu.max`` (``<quota> <period>`` or ``max <period>``); v1:
    ``cpu/.../cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (a quota of -1: none)."""
    root = CGROUP_ROOT if root is None else root
    v2_path, v1_path = _own_cgroups()
    limits = [_v2_limit(d) for d in _up_to(root, v2_path)] + [_v1_limit(d) for d in _up_to(root / "cpu", v1_path)]
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def _own_cgroups() -> tuple[str, str]:
    """This process's cgroup paths (v2's, v1's CPU controller's) from ``/proc/self/cgroup``; ``"/"`` when unknown."""
    v2 = v1 = "/"
    try:
        lines = SELF_CGROUP.read_text().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path or "/"
        elif "cpu" in controllers.split(","):
            v1 = path or "/"
    return v2, v1


def _up_to(top: Path, relative: str) -> list[Path]:
    """``top/relative`` and each of its parents up to ``top`` (those that exist), ``top`` last."""
    here = top / relative.lstrip("/")
    dirs = []
    while here != top and top in here.parents:
        if here.is_dir():
            dirs.append(here)
        here = here.parent
    return [*dirs, top]


def _v2_limit(directory: Path) -> int | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _rounded_up(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1_limit(directory: Path) -> int | None:
    try:
        return _rounded_up(int((directory / "cpu.cfs_quota_us").read_text()), int((directory / "cpu.cfs_period_us").read_text()))
    except (OSError, ValueError):
        return None


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


def cpuinfo_field(name: str, cpuinfo: Path = CPUINFO) -> str | None:
    """The first ``name`` line's value in ``/proc/cpuinfo`` (``"model name"``, ``"vendor_id"``); ``None`` where there is
    no such file (not Linux) or no such line."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None
