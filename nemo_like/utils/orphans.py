"""Files and folders a process names with its tag (``<prefix><pid>p<pid namespace>_...``, :func:`process_tag`), removed
once that process no longer runs: a killed run leaves them behind, and the next one that makes its own clears them."""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


@functools.cache
def pid_namespace() -> int:
    """This process's PID namespace (its inode; 0 where ``/proc`` does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_tag() -> str:
    """``<pid>p<pid namespace>``: what a name this process owns starts with. A pid alone names another process, or
    none, in a container with a PID namespace of its own that shares ``/tmp`` or ``/dev/shm`` (``docker --ipc=host``):
    another run's live buffer was swept as an orphan."""
    return f"{os.getpid()}p{pid_namespace()}"


def remove_orphan_temp_dirs(prefix: str, remove: Callable[[Path], None]) -> list[str]:
    """:func:`remove_orphans` over the temporary directory's entries named ``<prefix><tag>_...``."""
    return remove_orphans(Path(tempfile.gettempdir()).glob(f"{prefix}*_*"), prefix, remove)


def remove_orphans(paths: Iterable[Path], prefix: str, remove: Callable[[Path], None]) -> list[str]:
    """``remove`` each of ``paths`` named ``<prefix><tag>_...`` (:func:`process_tag`; an older ``<prefix><pid>_...``
    too) whose process no longer runs and that this user owns; returns their paths. A name without a pid there, one of
    another PID namespace, another user's (a shared /dev/shm or /tmp: its sticky bit refuses us), or one that cannot be
    removed, is left alone (not ours to judge, and never a reason to fail the run that swept)."""
    removed = []
    for path in paths:
        pid, _, namespace = path.name.removeprefix(prefix).split("_")[0].partition("p")
        try:
            if namespace and int(namespace) != pid_namespace():
                continue
            if path.lstat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                remove(path)
            except OSError:  # gone meanwhile, or not ours to remove after all
                continue
            removed.append(str(path))
        except (ValueError, OSError):  # PermissionError: another user's live process; FileNotFoundError: gone
            continue
    return removed
