"""The nemo-like runs alive on this machine, so that a run can warn when another one shares its cores.

A run (``nemo-like train``, ``nemo-like eval``) holds an exclusive ``flock`` on a file of its own in a per-user
directory, ``<tmp>/nemo_like-runs-<uid>/<pid>-<random>.run``, for its whole life; the file records its pid, start time,
output directory (a training run's ``logger.log_dir``) and the CPUs it may run on. Another run counts the files it
cannot lock whose CPUs overlap its own (jobs pinned to their own cores, Slurm's cgroups or ``taskset``, do not share
them): the kernel drops a lock when its process exits, however it exits, so a run that crashed is never counted (the
next run that finds its file unlocked removes it). Nothing here may fail a run: a directory that cannot be written, or
storage without file locks, leaves the run unregistered and unwarned, and unreadable files are skipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SUFFIX = ".run"
#: A file younger than this whose lock is free may belong to a run between creating it and locking it: kept.
STALE_AFTER_S = 60.0


def runs_directory() -> Path:
    """Where this user's runs register (one directory per user: another user's runs are not this user's to count)."""
    return Path(tempfile.gettempdir()) / f"nemo_like-runs-{os.getuid()}"


@dataclass(frozen=True)
class LiveRun:
    """Another run alive on this machine, as its file records it."""

    pid: int
    started: float
    directory: str  # what it writes: a training run's logger.log_dir, an eval's eval.output_dir
    cpus: frozenset[int] | None = None  # the CPUs it may run on (None: not recorded)

    def shares_cpus(self, cpus: frozenset[int]) -> bool:
        """Whether it may run on any of ``cpus`` (one that did not record its own may)."""
        return self.cpus is None or bool(self.cpus & cpus)

    def describe(self) -> str:
        """``pid N, started HH:MM:SS, writing to DIR``."""
        return f"pid {self.pid}, started {time.strftime('%H:%M:%S', time.localtime(self.started))}, writing to {self.directory}"


@contextlib.contextmanager
def registered_run(output_dir: str | Path, directory: Path | None = None) -> Iterator[None]:
    """Register this process's run, writing to ``output_dir``, for the ``with`` block (see the module docstring)."""
    directory = directory or runs_directory()
    fd, path = None, None
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        fd, path = tempfile.mkstemp(suffix=SUFFIX, prefix=f"{os.getpid()}-", dir=directory)
        fcntl.flock(fd, fcntl.LOCK_EX)
        record = {"pid": os.getpid(), "started": time.time(), "directory": str(output_dir), "cpus": sorted(_own_cpus())}
        os.write(fd, json.dumps(record).encode())
    except OSError:  # an unwritable temp dir, storage without file locks: the run goes on, unseen by the others
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)  # before the lock drops: no other run may see it free and remove another's file
            os.close(fd)


def _own_cpus() -> frozenset[int]:
    return frozenset(os.sched_getaffinity(0))


def other_live_runs(directory: Path | None = None) -> list[LiveRun]:
    """The runs of other processes registered and alive on this machine that may run on this process's CPUs (oldest
    first); stale files are removed."""
    directory = directory or runs_directory()
    try:
        files = sorted(directory.glob(f"*{SUFFIX}"))
    except OSError:
        return []
    runs, cpus = [], _own_cpus()
    for path in files:
        run = _live_run(path)
        if run is not None and run.pid != os.getpid() and run.shares_cpus(cpus):
            runs.append(run)
    return sorted(runs, key=lambda r: r.started)


def _live_run(path: Path) -> LiveRun | None:
    """The run registered in ``path`` when its lock is held, else None (the file removed once it is stale)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # removed meanwhile, or not ours to read
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: its run is alive
            try:
                record = json.loads(os.pread(fd, 65536, 0) or b"{}")
                cpus = frozenset(int(c) for c in record["cpus"]) if "cpus" in record else None
                return LiveRun(int(record["pid"]), float(record["started"]), str(record["directory"]), cpus)
            except (ValueError, KeyError, TypeError):  # still writing its record, or not ours
                return None
        except OSError:  # storage without file locks: nothing can be told (and nothing is removed)
            return None
        with contextlib.suppress(OSError):
            if time.time() - os.fstat(fd).st_mtime > STALE_AFTER_S:
                path.unlink()
        return None
    finally:
        os.close(fd)
