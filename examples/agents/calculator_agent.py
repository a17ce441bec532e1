"""A calculator agent written with the ``openai`` client: the agent of ``examples/configs/grpo_agent_tiny_cpu.yaml``.

The loop: ask the model; if it called a tool, run it (our calculator, ``nemo_like/environments/tools``) and send the
result back as a ``tool`` message; ask again; stop when the model answers without a tool call or after ``MAX_CALLS``
calls. It returns the conversation; the task's verifier (``env.tool.verifier: tool``) scores the final answer.

The run calls ``solve(base_url, api_key, session_id, prompt, metadata)`` once per sample; the session id goes in the
``X-Session-Id`` header (the server records every call of the session token for token). The same function runs
against ``nemo-like serve`` (any session id, e.g. ``"debug"``) or any other OpenAI-compatible endpoint.
"""

from __future__ import annotations

import json
import threading
from functools import lru_cache
from typing import Any

from openai import OpenAI

from nemo_like.environments.tools.registry import ToolRegistry

MAX_CALLS = 2  # the tiny tool model's episode: call the calculator, then answer
MAX_TOKENS = 16  # per call, as the multi-turn recipe (policy.generation.max_new_tokens)
TOOLS = ToolRegistry.from_config(["calculator"])
CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def run_tool(call: Any) -> str:
    """One tool call of the model's turn -> the text of the ``tool`` message (an error is an observation too)."""
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as exc:
        return f"error: {exc}"
    result = TOOLS.call(call.function.name, arguments if isinstance(arguments, dict) else {})
    return result.text if result.ok else f"error: {result.text}"


_CLIENT_LOCK = threading.Lock()  # sessions start together: without it each would build its own client at first


@lru_cache(maxsize=8)
def _client(base_url: str, api_key: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def client_for(base_url: str, api_key: str) -> OpenAI:
    """One client per server, shared by every session (thread-safe): building an ``OpenAI`` client costs tens of
    milliseconds of CPU (its HTTP client's TLS setup), as much as several calls to a small model, so a client per
    session would spend more on clients than on the rollout. Each call names its session in a header instead."""
    with _CLIENT_LOCK:
        return _client(base_url, api_key)


def solve(base_url: str, api_key: str, session_id: str, prompt: list[dict[str, str]], metadata: dict[str, Any]) -> list[dict[str, Any]]:
    """Roll out one episode; returns the messages (the last assistant message holds the answer)."""
    client = client_for(base_url, api_key)
    session = {"X-Session-Id": session_id}
    messages: list[dict[str, Any]] = list(prompt)
    for _ in range(MAX_CALLS):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR_SCHEMA], max_tokens=MAX_TOKENS, extra_headers=session
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    return messages
