"""One run per directory: an exclusive lock on a run's checkpoint and log directories.

Two runs writing one ``checkpointing.checkpoint_dir`` / ``logger.log_dir`` destroy each other's work
(one run's retention deletes the checkpoint the other resumes from; a resume trims the other run's
metrics). A run therefore holds ``<dir>/.nemo_like.lock`` for its whole life:

* taken atomically with ``fcntl.flock`` (exclusive, non-blocking) on the open file; the kernel drops
  it when the process exits, however it exits. On a shared filesystem this needs working file locks
  (NFSv4 and Lustre with ``flock`` have them);
* the file records the holder (host, PID, start time), so a refused run can name it;
* a clean release empties the record; a record left behind by a process that died is a stale lock,
  taken over with a warning.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from nemo_like.utils.files import remove_partial_files

if TYPE_CHECKING:
    from nemo_like.config.schema import MasterConfig

LOCK_FILE = ".nemo_like.lock"


def run_directories(cfg: MasterConfig) -> dict[str, Path]:
    """``{key: directory}`` a run writes and locks: the log directory, and the checkpoint directory when enabled."""
    dirs = {"logger.log_dir": Path(cfg.logger.log_dir)}
    if cfg.checkpointing.enabled:
        dirs["checkpointing.checkpoint_dir"] = Path(cfg.checkpointing.checkpoint_dir)
    return dirs


class RunLockError(RuntimeError):
    """Another live run holds the directory; the message names the holder and the directory."""


def _describe(owner: dict) -> str:
    if not owner:
        return "a run that is still starting (no holder recorded yet)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, started {started}"


def _read_owner(fd: int) -> dict:
    raw = os.pread(fd, 4096, 0)
    try:
        owner = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {"pid": "?", "host": "?", "raw": raw[:200].decode(errors="replace")}
    return owner if isinstance(owner, dict) else {}


class RunLock:
    """The exclusive lock of one directory (see the module docstring)."""

    def __init__(self, directory: str | Path, key: str) -> None:
        """``key`` is the recipe key that named the directory (used in messages)."""
        self.directory = Path(directory)
        self.key = key
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`RunLockError`; a dead holder's record is taken over with a warning."""
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # another user's lock file left in a shared directory
            raise RunLockError(
                f"{self.key}={self.directory}: cannot open the run lock {self.path}: {exc.strerror} (another user's lock "
                f"file, left in a shared directory?). Remove it if no run uses this directory, or give this run its own {self.key}."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_owner(fd))
            os.close(fd)
            raise RunLockError(
                f"{self.key}={self.directory} is in use by another run: {holder} (lock file {self.path}). Two runs on one "
                f"directory overwrite each other's checkpoints and metrics: wait for that run to finish or stop it, or give "
                f"this run its own {self.key}."
            ) from None
        except OSError as exc:  # storage without file locks (some network filesystems)
            os.close(fd)
            raise RunLockError(
                f"{self.key}={self.directory}: cannot lock {self.path}: {exc.strerror}. The storage does not support flock "
                f"(an NFS mount without locking?): point {self.key} at storage that does."
            ) from None
        previous = _read_owner(fd)
        if previous:
            warnings.warn(
                f"{self.key}={self.directory}: taking over the lock of a run that is gone ({_describe(previous)}; it did not exit cleanly)",
                RuntimeWarning,
                stacklevel=2,
            )
            if isinstance(previous.get("pid"), int):
                remove_partial_files(self.directory, previous["pid"])  # the files it was writing when it died
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Empty the holder record and drop the lock (idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # a clean exit leaves no holder behind: the next run takes it without a warning
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


@contextmanager
def hold_run_locks(directories: Mapping[str, str | Path]) -> Iterator[list[RunLock]]:
    """Lock every ``{key: directory}`` (one lock per distinct directory) for the ``with`` block."""
    seen: set[Path] = set()
    with ExitStack() as stack:
        locks = []
        for key, directory in directories.items():
            resolved = Path(directory).resolve()
            if resolved in seen:
                continue
            seen.add(resolved)
            lock = RunLock(directory, key)
            lock.acquire()
            stack.callback(lock.release)
            locks.append(lock)
        yield locks
