"""The error a tool raises to fail a call in a known way; the registry and the built-in tools share it.

Users import it from :mod:`nemo_like.environments.tools.registry` (re-exported there).
"""

from __future__ import annotations


class ToolError(Exception):
    """A tool call failed in a known way; ``kind`` is counted (e.g. ``timeout``, ``memory``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
