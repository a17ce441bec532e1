"""Parse Hermes/Qwen tool calls out of a model turn.

Format (the one Qwen2.5 and Hermes chat templates teach)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "347*28"}}</tool_call>

A turn may hold several calls. ``arguments`` is a JSON object (a JSON *string* holding an object is
accepted too, as some models emit it). Anything else inside the tags is a :class:`ToolCallError`, never
an exception: the environment turns it into an error observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_CALL = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)


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
        payload = json.loads(body)
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
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            return ToolCallError(f"'arguments' of {name!r} is a string that is not a JSON object")
    if not isinstance(arguments, dict):
        return ToolCallError(f"'arguments' of {name!r} must be a JSON object, got {type(arguments).__name__}")
    unknown = set(payload) - {"name", "arguments"}
    if unknown:
        return ToolCallError(f"unexpected keys {sorted(unknown)} in the call of {name!r} (only 'name' and 'arguments')")
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every ``<tool_call>...</tool_call>`` of ``text`` in order, each parsed or an error.

    An opening tag without its closing tag (e.g. generation cut by the token limit) is one error.
    Returns ``[]`` when the text calls no tool."""
    calls: list[ToolCall | ToolCallError] = [_parse_one(match.group(1).strip()) for match in _CALL.finditer(text)]
    if text.count(OPEN_TAG) > len(calls):
        calls.append(ToolCallError(f"unterminated {OPEN_TAG} (no {CLOSE_TAG})"))
    return calls


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The canonical text of one call (what warm-start data and docs use)."""
    return OPEN_TAG + json.dumps({"name": name, "arguments": arguments}) + CLOSE_TAG
