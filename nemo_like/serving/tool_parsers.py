"""Tool-call parsers: a completion's text -> OpenAI ``content`` and ``tool_calls`` (plug-ins by name).

A parser is a callable ``(text) -> ParsedTurn``. Built-in: ``hermes`` (Hermes/Qwen ``<tool_call>{json}</tool_call>``,
:mod:`nemo_like.environments.tools.parsing`). User code: ``"my_pkg.parsers:parse"`` or ``"file.py:parse"``
(:data:`TOOL_PARSERS`, a :class:`~nemo_like.utils.registry.Registry`). Parsing only shapes the answer: the sampled
ids are recorded unchanged, and a returned message is rendered back as the raw text (:mod:`.continuation`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nemo_like.environments.tools.parsing import OPEN_TAG, ToolCall, parse_tool_calls
from nemo_like.utils.registry import Registry


@dataclass(frozen=True)
class ParsedTurn:
    """``content``: the text outside the tool markup (None when empty and there are calls);
    ``tool_calls``: OpenAI ``tool_calls`` entries (empty when the turn calls no tool or its markup is malformed)."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


ToolParser = Callable[[str], ParsedTurn]

TOOL_PARSERS: Registry[ToolParser] = Registry("tool parser", "agent.tool_parser")


def openai_tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One entry of OpenAI's ``message.tool_calls`` (a fresh ``call_...`` id, arguments as a JSON string)."""
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, allow_nan=False)},
    }


@TOOL_PARSERS.register("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    """Hermes/Qwen markup, as vLLM's ``hermes`` parser reads it: every ``<tool_call>`` must parse, else the whole text
    stays ``content``; a last call without its closing tag counts when its JSON parses (``stop=["</tool_call>"]``);
    ``content`` is the text before the first call, whitespace kept (None when empty).

    Only the server is this lenient: the tool environment's :func:`parse_tool_calls` keeps calling an unclosed tag an
    error (a turn cut by the token limit)."""
    if OPEN_TAG not in text:
        return ParsedTurn(text)
    calls = parse_tool_calls(text, keep_unclosed=True)  # a call stop=["</tool_call>"] cut before its tag still counts
    if not calls or not all(isinstance(c, ToolCall) for c in calls):
        return ParsedTurn(text)
    before = text[: text.index(OPEN_TAG)]
    return ParsedTurn(before or None, [openai_tool_call(c.name, c.arguments) for c in calls])


@TOOL_PARSERS.register("none")
def parse_nothing(text: str) -> ParsedTurn:
    """No tool parsing: the text is the content."""
    return ParsedTurn(text)
