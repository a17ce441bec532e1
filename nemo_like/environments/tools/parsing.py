"""Parse Hermes/Qwen tool calls out of a model turn.

Format (the one Qwen2.5 and Hermes chat templates teach)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "347*28"}}</tool_call>

A turn may hold several calls. ``arguments`` is a JSON object (a JSON *string* holding an object is
accepted too, as some models emit it). Anything else inside the tags is a :class:`ToolCallError`, never
an exception: the environment turns it into an error observation.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past a float's range")
    return value


# Python's json reads NaN, Infinity and -Infinity, and a number past a float's range (1e400) as inf; no JSON parser of
# another language does, and an agent gets the arguments back as a JSON string: they are malformed calls here.
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A malformed call: what was wrong (becomes ``"error: <message>"`` in the observation)."""

    message: str


def has_tool_call(text: str) -> bool:
    """Whether the turn tries to call a tool (an opening tag, well-formed or not)."""
    return OPEN_TAG in text


def _parse_one(body: str) -> ToolCall | ToolCallError:
    try:
        payload = _DECODER.decode(body)
    except json.JSONDecodeError as exc:
        return ToolCallError(f"malformed JSON in <tool_call>: {exc.msg} at char {exc.pos}")
    except (ValueError, RecursionError) as exc:  # nesting past the parser's depth, an integer past 4300 digits
        return ToolCallError(f"unreadable JSON in <tool_call>: {type(exc).__name__}: {str(exc)[:120]}")
    if not isinstance(payload, dict):
        return ToolCallError(f"a tool call must be a JSON object with 'name' and 'arguments', got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError("a tool call needs a non-empty string 'name'")
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = _DECODER.decode(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            return ToolCallError(f"'arguments' of {echoed(name)} is a string that is not a JSON object")
    if not isinstance(arguments, dict):
        return ToolCallError(f"'arguments' of {echoed(name)} must be a JSON object, got {type(arguments).__name__}")
    unknown = set(payload) - {"name", "arguments"}
    if unknown:
        keys = ", ".join(echoed(k) for k in sorted(unknown)[:MAX_ECHOED_KEYS]) + (", ..." if len(unknown) > MAX_ECHOED_KEYS else "")
        return ToolCallError(f"unexpected keys [{keys}] in the call of {echoed(name)} (only 'name' and 'arguments')")
    return ToolCall(name, arguments)


#: How much of the model's own text (a tool's name, a key) an error observation repeats: a degenerate 20,000-character
#: name came back whole, past the tool-output cut (``MAX_RESULT_CHARS``) and uncounted.
MAX_ECHOED_CHARS = 80
MAX_ECHOED_KEYS = 5


def echoed(text: str) -> str:
    """``repr(text)``, cut to :data:`MAX_ECHOED_CHARS` characters (the cut said by a trailing ``...``)."""
    return repr(text) if len(text) <= MAX_ECHOED_CHARS else repr(text[:MAX_ECHOED_CHARS]) + "..."


def _json_end(text: str, start: int) -> int | None:
    """The end of the JSON value starting at ``start`` (after whitespace); ``None`` when none decodes there."""
    try:
        return _DECODER.raw_decode(text, _SPACE.match(text, start).end())[1]
    except (ValueError, RecursionError):
        return None


#: Failed JSON decodes allowed in one text: each costs time in its position in the text (json counts the lines before
#: it), so a degenerate turn repeating ``<tool_call>{`` without closing it was quadratic (3 s at 40,000 tags).
MAX_MALFORMED_CALLS = 256


def _nested(text: str, opened: int) -> bool:
    """Whether the call opened at ``opened`` sits inside the call before it: after its closing tag, another closing tag
    comes before any opening tag (the outer call's: code in the outer call's arguments writes a whole call)."""
    value_end = _json_end(text, opened + len(OPEN_TAG))  # a closing tag inside its strings does not close it
    after = _SPACE.match(text, value_end).end() if value_end is not None else None
    inner_close = after if after is not None and text.startswith(CLOSE_TAG, after) else text.find(CLOSE_TAG, opened)
    if inner_close == -1:
        return False
    outer_close = text.find(CLOSE_TAG, inner_close + len(CLOSE_TAG))
    later_open = text.find(OPEN_TAG, inner_close)
    return outer_close != -1 and (later_open == -1 or outer_close < later_open)


def tool_call_bodies(text: str, keep_unclosed: bool = False) -> tuple[list[str | ToolCallError], bool]:
    """The text inside each ``<tool_call>...</tool_call>`` of ``text`` in order, and whether the last opening tag is
    left unclosed. A call ends at the closing tag after its JSON value (a ``</tool_call>`` inside one of its strings,
    code that prints it, does not end it), else (malformed JSON, or text after the value) at the next closing tag. A
    call whose next tag is the next ``<tool_call>`` (after its value, or after malformed JSON when that call does not
    nest in this one: :func:`_nested`) is an error of its own (its closing tag is missing), and the next call is read on its own (it was read as part of this
    one's body: both lost, and the error blamed the JSON).
    ``keep_unclosed``: an unclosed last call is a body too, running to the end (then never reported unclosed)."""
    bodies: list[str | ToolCallError] = []
    position, malformed = 0, 0
    next_close: int | None = None  # the first closing tag at or after a call's start (None: not looked up yet)
    while (opened := text.find(OPEN_TAG, position)) != -1:
        start = opened + len(OPEN_TAG)
        value_end = _json_end(text, start)
        if value_end is None:
            malformed += 1
            if malformed > MAX_MALFORMED_CALLS:
                bodies.append(ToolCallError(f"more than {MAX_MALFORMED_CALLS} malformed calls in one text: the rest is not read"))
                return bodies, False
        after = _SPACE.match(text, value_end).end() if value_end is not None else None
        if after is not None and (after == len(text) or text.startswith(CLOSE_TAG, after)):
            close = after if after < len(text) else -1  # the value, then its closing tag (or the end: a cut call)
        else:
            if next_close is None or 0 <= next_close < start:  # looked up again only once passed: one scan of the text
                next_close = text.find(CLOSE_TAG, start)
            close = next_close
            following = text.find(OPEN_TAG, value_end if value_end is not None else start)
            if following != -1 and (close == -1 or following < close) and (value_end is not None or not _nested(text, following)):
                bodies.append(ToolCallError(f"missing {CLOSE_TAG} before the next {OPEN_TAG}"))
                position = following
                continue
        if close == -1:
            if keep_unclosed:
                bodies.append(text[start:])
            return bodies, not keep_unclosed
        bodies.append(text[start:close])
        position = close + len(CLOSE_TAG)
    return bodies, False


def parse_tool_calls(text: str, keep_unclosed: bool = False) -> list[ToolCall | ToolCallError]:
    """Every ``<tool_call>...</tool_call>`` of ``text`` in order, each parsed or an error.

    An opening tag without its closing tag (e.g. generation cut by the token limit) is one error, unless
    ``keep_unclosed`` (the server's reading of a call an agent's stop string cut: parsed like a closed one).
    Returns ``[]`` when the text calls no tool."""
    bodies, unterminated = tool_call_bodies(text, keep_unclosed)
    calls = [body if isinstance(body, ToolCallError) else _parse_one(body.strip()) for body in bodies]
    if unterminated:
        calls.append(ToolCallError(f"unterminated {OPEN_TAG} (no {CLOSE_TAG})"))
    return calls


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The canonical text of one call (what warm-start data and docs use)."""
    return OPEN_TAG + json.dumps({"name": name, "arguments": arguments}) + CLOSE_TAG
