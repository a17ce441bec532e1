"""What learned reward sources (reward models, judges) read from a sample: the prompt text and the model path.

The prompt comes from the sample's metadata: ``metadata["prompt"]`` (a string), else the text of the last user message of
``metadata["messages"]`` (a string, or its text parts joined); a sample with neither is scored with an empty prompt and counted (``prompt_missing``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator

_ASSETS = Path(__file__).resolve().parents[1] / "assets"


def prompt_of(metadata: Mapping[str, Any]) -> str | None:
    """The prompt text of a sample, or ``None`` when its metadata carries none (see the module docstring)."""
    prompt = metadata.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = metadata.get("messages")
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, Mapping) and message.get("role") == "user":
                return message_text(message.get("content"))
    return None


def message_text(content: Any) -> str | None:
    """A message's text: a string, or the joined ``text`` parts of OpenAI-style content parts (``None`` without any)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
        ]
        return "".join(texts) if texts else None
    return None


def cut_from_left(ids: list[int], limit: int, tokenizer: Any, aligned: list[int] | None = None) -> list[int]:
    """``ids`` cut to ``limit`` tokens by dropping tokens after the first, which is kept when it is the tokenizer's CLS
    or BOS (an encoder's classifier reads CLS; a decoder expects its BOS), so the response at the end survives.
    ``aligned``: values per token of ``ids`` (a text pair's token type ids), cut at the same places instead."""
    values = ids if aligned is None else aligned
    if len(ids) <= limit:
        return values
    leading = {getattr(tokenizer, "cls_token_id", None), getattr(tokenizer, "bos_token_id", None)} - {None}
    keep = 1 if limit > 1 and ids[0] in leading else 0
    return values[:keep] + values[len(ids) - (limit - keep) :]


def resolve_reward_model_path(name: str) -> str:
    """The local directory of model ``name``: shipped ``embedded:`` models (``embedded:tiny-reward-qwen2`` among them,
    :data:`nemo_like.models.assets.OTHER_MODELS`), hub ids and paths, as the generation models resolve them."""
    from nemo_like.models.loading import resolve_model_path

    return resolve_model_path(name)


def check_model_name(name: str, key: str = "model_name") -> str:
    """Fail in the driver when model ``name`` cannot be loaded here (shipped name, local directory, cached hub id);
    returns it as the environment's actors must be given it (a relative local path made absolute:
    :func:`~nemo_like.models.loading.actor_model_source`; a pydantic validator: the error is a ``ValueError`` naming
    ``key``)."""
    from nemo_like.models.loading import actor_model_source, check_model_source

    check_model_source(name, key)
    return actor_model_source(name)


#: A learned reward's ``model_name`` key: checked loadable when the section is validated (:func:`check_model_name`).
ModelName = Annotated[str, AfterValidator(check_model_name)]
