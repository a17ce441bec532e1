"""Files and folders a process names with its id (``<prefix><pid>_...``), removed once that process no longer runs: a
killed run leaves them behind, and the next one that makes its own clears them."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path


def remove_orphans(paths: Iterable[Path], prefix: str, remove: Callable[[Path], None]) -> list[str]:
    """``remove`` each of ``paths`` named ``<prefix><pid>_...`` whose process no longer runs; returns their paths. A
    name without a pid there, or another user's live process, is left alone (not ours to judge)."""
    removed = []
    for path in paths:
        try:
            os.kill(int(path.name.removeprefix(prefix).split("_")[0]), 0)
        except ProcessLookupError:
            remove(path)
            removed.append(str(path))
        except (ValueError, PermissionError):
            continue
    return removed
