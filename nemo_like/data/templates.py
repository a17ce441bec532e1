"""Prompt files and chat messages: ``data.prompt_file``, ``data.system_prompt(_file)``.

A prompt file is a Python ``str.format`` template with one positional field ``{}`` that receives the
problem text (NeMo-RL's convention); literal braces, e.g. in ``\\boxed{{}}``, are written doubled.
The messages built here are rendered by the model's own chat template (``apply_chat_template``).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import DataConfig


@dataclass(frozen=True)
class PromptFormat:
    """How one problem becomes chat messages: an optional user template and system message."""

    template: str | None = None
    system_prompt: str | None = None

    def user_text(self, problem: str) -> str:
        """The user message for ``problem`` (the template applied, if any)."""
        return self.template.format(problem) if self.template is not None else problem

    def messages_for_text(self, problem: str) -> list[dict[str, str]]:
        """Chat messages for a plain-text problem: optional system turn, then the user turn."""
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": self.user_text(problem)})
        return messages

    def messages_for_chat(self, chat: list[dict[str, Any]], where: str) -> list[dict[str, str]]:
        """Apply the format to a row's own chat messages (``where`` names the row in errors).

        A message keeps its ``role`` and ``content`` only (see :func:`_check_message`). The last user
        turn must hold text (a blank one is an error, as a blank text prompt is); the template wraps it; the
        system prompt is prepended unless the row already has a system turn, which is an error (two system prompts).
        """
        messages = [_check_message(m, where, n) for n, m in enumerate(chat, 1)]
        if not any(m["role"] == "user" for m in messages):
            raise ConfigError(f"{where}: the chat messages have no 'user' turn")
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        if not messages[last]["content"].strip():  # the question the model is asked would be empty
            raise ConfigError(f"{where}: the last 'user' turn of the chat messages (data.prompt_key) is empty")
        if messages[-1]["role"] == "assistant":  # an SFT-style row: its answer would sit in the prompt
            raise ConfigError(
                f"{where}: the chat messages end with an 'assistant' turn, so the prompt would hold the answer; a prompt "
                "ends where the model answers (drop the rows' last turn, or point data.prompt_key at the question)"
            )
        if self.template is not None:
            messages[last] = {**messages[last], "content": self.user_text(messages[last]["content"])}
        if self.system_prompt:
            if any(m["role"] == "system" for m in messages):
                raise ConfigError(
                    f"{where}: the row's messages already have a system turn and data.system_prompt(_file) adds another; "
                    "unset data.system_prompt / data.system_prompt_file"
                )
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages


def _check_message(message: Any, where: str, number: int) -> dict[str, str]:
    """``message`` as the chat template gets it: its ``role`` and ``content`` (text). Its other keys are not passed
    (tool calls, names, a chat log's timestamps: their shapes differ between formats and tables, and a template would
    render them otherwise than the rollout server does); :func:`dropped_message_keys` names them (one printed line per split).
    ``number`` counts the row's messages from 1, for errors."""
    if not (isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
        raise ConfigError(f"{where}: chat message {number} must be {{'role': str, 'content': str}}, got {message!r}")
    return {"role": message["role"], "content": message["content"]}


def dropped_message_keys(chat: list[Any]) -> set[str]:
    """The keys besides ``role`` and ``content`` that the messages of ``chat`` hold a value for (a table's ``None``
    fill does not count): the prompt leaves them out."""
    return {key for m in chat if isinstance(m, dict) for key, value in m.items() if key not in ("role", "content") and value is not None}


def _read_text(path: str, key: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8-sig")  # an editor's byte-order mark is not part of the text
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path!r} ({exc.strerror or exc}); the path is relative to the working directory") from None


def load_prompt_template(path: str) -> str:
    """Read and check a ``data.prompt_file``: exactly one ``{}`` field and nothing else to fill."""
    text = _read_text(path, "data.prompt_file")
    text = text[:-1] if text.endswith("\n") else text  # an editor's final newline is not part of the prompt
    try:
        parsed = [(f, spec, conversion) for _, f, spec, conversion in string.Formatter().parse(text) if f is not None]
    except ValueError as exc:
        raise ConfigError(f"data.prompt_file {path!r} is not a valid template ({exc}); write literal braces as '{{{{' and '}}}}'") from None
    fields = [f for f, _, _ in parsed]
    if fields == [""] and parsed[0][1:] != ("", None):  # '{:.20}' cut every problem to 20 characters, '{!r}' quoted it
        spec, conversion = parsed[0][1:]
        found = "{" + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        raise ConfigError(f"data.prompt_file {path!r}: the '{{}}' field takes no format spec or conversion (found '{found}')")
    if fields != [""]:
        raise ConfigError(
            f"data.prompt_file {path!r} must contain exactly one '{{}}' (where the problem goes) and no other fields, "
            f"found {['{' + f + '}' for f in fields] or 'none'}; write literal braces as '{{{{' and '}}}}'"
        )
    return text


def prompt_format(data: DataConfig) -> PromptFormat:
    """The prompt format a config asks for (reads the prompt and system-prompt files)."""
    template = load_prompt_template(data.prompt_file) if data.prompt_file else None
    system = data.system_prompt  # as written (stripping it would change the prompts, and the fingerprint, of checkpoints)
    if data.system_prompt_file:
        system = _read_text(data.system_prompt_file, "data.system_prompt_file").strip()
        if not system:  # a broken write trained with no system prompt, silently
            raise ConfigError(f"data.system_prompt_file {data.system_prompt_file!r} is empty; write the system message or unset the key")
    return PromptFormat(template, system or None)
