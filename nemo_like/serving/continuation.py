"""Token-in, token-out across HTTP calls: a session's next prompt reuses the ids the engine already sampled.

An agent sends back the whole conversation as text; re-tokenising it would change ids (BPE is not a bijection) and
the training row would hold tokens the model never sampled. So per session the server keeps, for every completion,
the text its ids encode (the rendered prompt plus the decoded completion) and those ids. A new rendering that starts
with one of these texts becomes those ids plus the tokenised remainder (:meth:`Continuations.prompt_ids`; encoded as a
continuation, so a SentencePiece tokenizer adds no word-start space to it): the prompt
then extends the earlier call exactly, and the session stays one row. A rendering that starts with none of them (the
template rewrote history) is tokenised whole and the session branches (:mod:`.trajectory`).

It also maps every assistant message the server returned to the raw text the model sampled
(:meth:`Continuations.raw_text`, keyed by :func:`message_keys` placed after the history it answered,
:func:`placed_keys`), so a message whose tool calls were parsed out is rendered back as the markup the model wrote, not
as the template's re-serialisation of the parsed JSON, and a message whose content another turn also returned (a stop
string cut both to the same text) as its own sampled text, not the other turn's.

An agent sends its whole history at every call, so whatever touches every message at every call costs a session time
quadratic in its turns (a peer measured re-rendering at 56% of generation time at 128 turns, trl#6250). Normalising
the messages for the template is paid once per message: the previous call's messages and their normalised forms are
kept (:meth:`Continuations.normalized`), and a message equal to the one sent at the same position last time, whose
raw-text lookup still gives the same answer, is not normalised again. (Parsing the body and rendering the template
still read the whole history: ``benchmarks/long_sessions.py``.)
"""

from __future__ import annotations

import bisect
import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def _call_fields(call: Any) -> tuple[Any, Any, Any]:
    """A tool call's id, name and argument string (None where a malformed entry lacks them: the renderer refuses it)."""
    function = call.get("function") if isinstance(call, dict) else None
    function = function if isinstance(function, dict) else {}
    return (call.get("id") if isinstance(call, dict) else None), function.get("name"), function.get("arguments")


def message_keys(content: str | None, tool_calls: Sequence[dict[str, Any]] | None) -> tuple[str, ...]:
    """A returned assistant message's identities, most specific first: its content and its tool calls' ids, names and
    argument strings; then the same without the ids (only the first when it has no call ids).

    The server's call ids are unique, so two messages with the same content and calls, sampled as different raw text
    (other whitespace; another turn or another choice of ``n``), each keep their own; the id-less key still finds the
    raw text of a message whose client rewrote the ids."""
    fields = [_call_fields(call) for call in tool_calls or ()] if isinstance(tool_calls, list) else []
    without_ids = json.dumps([content or "", [[name, arguments] for _, name, arguments in fields]])
    ids = [call_id for call_id, _, _ in fields]
    if not any(ids):
        return (without_ids,)
    return json.dumps([content or "", [[call_id, name, arguments] for call_id, name, arguments in fields]]), without_ids


def placed_keys(context: str, keys: Sequence[str]) -> tuple[str, ...]:
    """``keys`` (:func:`message_keys`) of a message that follows the history whose digest is ``context``
    (:meth:`Continuations.history_digests`), then the same keys anywhere: a client that edited the history before the
    message still finds the raw text of the last returned message with that content and calls."""
    return (*(f"{context}|{key}" for key in keys), *keys)


def _extend_digest(digest: str, message: Any) -> str:
    """The digest of a history extended by ``message`` (a request message: parsed JSON)."""
    text = json.dumps(message, sort_keys=True, default=str)
    return hashlib.blake2b(f"{digest}\n{text}".encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class RawLookup:
    """What normalising an assistant message asked: the raw text remembered for the first of ``keys`` that has one
    (None: none had)."""

    keys: tuple[str, ...]
    raw_text: str | None


#: Normalise one message (message, its index, the digest of the messages before it) -> (the template's form, the
#: raw-text lookup it depended on or None).
Normalize = Callable[[Any, int, str], tuple[dict[str, Any], RawLookup | None]]


class Continuations:
    """Per session: (text, ids) of every completion so far, and returned assistant messages -> their raw text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._encoded: list[tuple[str, tuple[int, ...]]] = []  # longest text first; equal lengths in the order added
        self._raw: dict[str, str] = {}
        self._last_sent: list[Any] = []  # the messages of the last chat call
        self._last_normalized: list[tuple[dict[str, Any], RawLookup | None]] = []  # theirs: (normalised, lookup)
        self._last_digests: list[str] = [""]  # theirs: history_digests

    def add(self, text: str, ids: Sequence[int]) -> None:
        """Remember that ``ids`` (a prompt plus its completion) encode ``text``."""
        with self._lock:
            bisect.insort(self._encoded, (text, tuple(ids)), key=lambda entry: -len(entry[0]))

    def remember_message(self, keys: Sequence[str], raw_text: str, context: str = "") -> None:
        """The assistant message with :func:`message_keys` ``keys`` was sampled as ``raw_text``, answering the history
        with digest ``context`` (:meth:`history_digests`)."""
        with self._lock:
            for key in placed_keys(context, keys):
                self._raw[key] = raw_text

    def history_digests(self, messages: Sequence[Any]) -> list[str]:
        """``digests[i]``: a digest of ``messages[:i]`` (``len(messages) + 1`` of them); the last call's are reused for
        the history it shares, so a call hashes only its new messages."""
        messages = list(messages)
        return self._digests(messages, *self._last_call(messages)[2:])

    def _last_call(self, messages: list[Any]) -> tuple[list[Any], list[tuple[dict[str, Any], RawLookup | None]], list[str], int]:
        """The last chat call's messages, normalised forms and digests, and how many leading ``messages`` it shares
        (usually the history is the last call's, extended: one comparison of the lists)."""
        with self._lock:
            last_sent, last, last_digests = self._last_sent, self._last_normalized, self._last_digests
        return last_sent, last, last_digests, len(last_sent) if messages[: len(last_sent)] == last_sent else 0

    @staticmethod
    def _digests(messages: list[Any], last_digests: list[str], common: int) -> list[str]:
        digests = last_digests[: common + 1]
        for message in messages[common:]:
            digests.append(_extend_digest(digests[-1], message))
        return digests

    def raw_text(self, keys: Sequence[str]) -> str | None:
        """The raw sampled text of a returned message (the first of its ``keys`` remembered), or None for a message the
        server did not return."""
        with self._lock:
            return self._find(keys)

    def _find(self, keys: Sequence[str]) -> str | None:
        return next((self._raw[key] for key in keys if key in self._raw), None)

    def normalized(self, messages: Sequence[Any], normalize: Normalize) -> list[dict[str, Any]]:
        """``normalize(message, index, digest of the messages before it)[0]`` of every message; the previous call's
        result is reused for a message equal to the one at the same index then, unless its raw-text lookup would now
        answer differently (or was made after another history: the lookup is placed after it)."""
        messages = list(messages)
        last_sent, last, last_digests, common = self._last_call(messages)
        digests = self._digests(messages, last_digests, common)
        with self._lock:

            def still_answers(lookup: RawLookup | None, index: int) -> bool:
                return lookup is None or (digests[index] == last_digests[index] and self._find(lookup.keys) == lookup.raw_text)

            reuse = [
                index < len(last) and (index < common or messages[index] == last_sent[index]) and still_answers(last[index][1], index)
                for index in range(len(messages))
            ]
        entries = [last[index] if reuse[index] else normalize(message, index, digests[index]) for index, message in enumerate(messages)]
        with self._lock:
            self._last_sent, self._last_normalized, self._last_digests = messages, entries, digests
        return [form for form, _ in entries]

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
