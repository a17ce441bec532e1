"""Files replaced whole: written beside their place (``<name>.tmp``), then renamed into it, so a reader (or a crash)
never finds half of one."""

from __future__ import annotations

import os
from pathlib import Path


def replace_file(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path``, replacing what was there in one rename; returns the path."""
    path = Path(path)
    partial = path.with_name(path.name + ".tmp")
    if isinstance(data, bytes):
        partial.write_bytes(data)
    else:
        partial.write_text(data, encoding="utf-8")
    os.replace(partial, path)
    return path
