"""A signal sent to one thread of another process, as the kernel may hand a process's signal to any of its threads
(Python runs its handlers in the main thread only, and only once that thread wakes)."""

from __future__ import annotations

import ctypes
import os
import platform

import pytest

#: tgkill's system call number by machine (Python has no call for it).
TGKILL = {"x86_64": 234, "aarch64": 131}


def skip_without_tgkill() -> None:
    """Skip the calling test where :data:`TGKILL` lacks this machine's number."""
    if platform.machine() not in TGKILL:
        pytest.skip(f"tgkill's number on {platform.machine()} is not in TGKILL")


def signal_thread(pid: int, tid: int, signum: int) -> None:
    """Send ``signum`` to thread ``tid`` (its native id) of process ``pid``."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(TGKILL[platform.machine()], pid, tid, signum) == 0, os.strerror(ctypes.get_errno())
