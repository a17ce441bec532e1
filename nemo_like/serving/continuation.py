"""Token-in, token-out across HTTP calls: a session's next prompt reuses the ids the engine already sampled.

An agent sends back the whole conversation as text; re-tokenising it would change ids (BPE is not a bijection) and
the training row would hold tokens the model never sampled. So per session the server keeps, for every completion,
the text its ids encode (the rendered prompt plus the decoded completion) and those ids. A new rendering that starts
with one of these texts becomes those ids plus the tokenised remainder (:meth:`Continuations.prompt_ids`; encoded as a
continuation, so a SentencePiece tokenizer adds no word-start space to it): the prompt
then extends the earlier call exactly, and the session stays one row. A rendering that starts with none of them (the
template rewrote history) is tokenised whole and the session branches (:mod:`.trajectory`).

It also maps every assistant message the server returned to the raw text the model sampled
(:meth:`Continuations.raw_text`), so a message whose tool calls were parsed out is rendered back as the markup the
model wrote, not as the template's re-serialisation of the parsed JSON.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any


def message_key(content: str | None, tool_calls: Sequence[dict[str, Any]] | None) -> str:
    """A returned assistant message's identity: its content and its tool calls' names and argument strings."""
    calls = [[c.get("function", {}).get("name"), c.get("function", {}).get("arguments")] for c in tool_calls or ()]
    return json.dumps([content or "", calls])


class Continuations:
    """Per session: (text, ids) of every completion so far, and returned assistant messages -> their raw text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._encoded: list[tuple[str, tuple[int, ...]]] = []  # longest text first; equal lengths in the order added
        self._raw: dict[str, str] = {}

    def add(self, text: str, ids: Sequence[int]) -> None:
        """Remember that ``ids`` (a prompt plus its completion) encode ``text``."""
        with self._lock:
            bisect.insort(self._encoded, (text, tuple(ids)), key=lambda entry: -len(entry[0]))

    def remember_message(self, key: str, raw_text: str) -> None:
        """The assistant message with :func:`message_key` ``key`` was sampled as ``raw_text``."""
        with self._lock:
            self._raw[key] = raw_text

    def raw_text(self, key: str) -> str | None:
        """The raw sampled text of a returned message, or None for a message the server did not return."""
        with self._lock:
            return self._raw.get(key)

    def prompt_ids(
        self, text: str, tokenize: Callable[[str], list[int]], tokenize_rest: Callable[[str], list[int]] | None = None
    ) -> list[int]:
        """The ids of the rendered prompt ``text``: the longest remembered text that starts it, with its ids, plus the
        remainder tokenised by ``tokenize_rest`` (as a continuation: no SentencePiece word marker of its own; default
        ``tokenize``); the whole text tokenised when none starts it."""
        # Longest first, so the first match is the one: in a session that only extends, the latest completion, found
        # with one comparison instead of one per earlier call.
        with self._lock:
            match = next(((t, ids) for t, ids in self._encoded if len(t) <= len(text) and text.startswith(t)), None)
        if match is None:
            return tokenize(text)
        prefix_text, prefix_ids = match
        rest = text[len(prefix_text) :]
        return list(prefix_ids) + ((tokenize_rest or tokenize)(rest) if rest else [])
