"""Answers in OpenAI's JSON shapes (``chat.completion``, ``text_completion``, the model list)."""

from __future__ import annotations

import codecs
import time
from typing import Any

from nemo_like.serving.protocol import ChatCompletionRequest, CompletionRequest
from nemo_like.serving.service import SampledCall, SampledChoice, response_extras


def _usage(call: SampledCall) -> dict[str, int]:
    completion = sum(len(c.completion_ids) for c in call.choices)
    return {"prompt_tokens": len(call.prompt_ids), "completion_tokens": completion, "total_tokens": len(call.prompt_ids) + completion}


def _chat_logprobs(choice: SampledChoice, decode_token: Any, token_bytes: Any) -> dict[str, Any]:
    """Per sampled token: its text, logprob and its own bytes (``token_bytes(id)``; a token holding part of a UTF-8
    character decodes to U+FFFD, whose bytes are not the token's)."""

    def entry(t: int, lp: float) -> dict[str, Any]:
        raw = token_bytes(t) if token_bytes is not None else decode_token(t).encode()
        return {"token": decode_token(t), "logprob": lp, "bytes": list(raw), "top_logprobs": []}

    return {"content": [entry(t, lp) for t, lp in zip(choice.completion_ids, choice.logprobs)]}


def _response_body(kind: str, call: SampledCall, req: Any, response_id: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """The OpenAI response object of ``kind`` around its ``choices``; with ``return_token_ids`` each choice and the
    body carry the ids (:func:`response_extras`)."""
    if req.return_token_ids:
        for entry, choice in zip(choices, call.choices):
            entry.update(response_extras(call, choice))
    body = {"id": response_id, "object": kind, "created": int(time.time()), "model": req.model, "choices": choices, "usage": _usage(call)}
    if req.return_token_ids:
        body.update(response_extras(call))
    return body


def chat_response(
    call: SampledCall, req: ChatCompletionRequest, response_id: str, decode_token: Any = str, token_bytes: Any = None
) -> dict[str, Any]:
    """A ``chat.completion`` object; ``decode_token(id)`` names tokens in ``logprobs``, ``token_bytes(id)`` gives their
    bytes (None: the UTF-8 of ``decode_token(id)``)."""
    choices = []
    for choice in call.choices:
        parsed = choice.parsed
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content if parsed else choice.text}
        if parsed and parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        entry: dict[str, Any] = {
            "index": choice.index,
            "message": message,
            "finish_reason": choice.finish_reason,
            "logprobs": _chat_logprobs(choice, decode_token, token_bytes) if req.logprobs else None,
        }
        choices.append(entry)
    return _response_body("chat.completion", call, req, response_id, choices)


def _completion_tokens(ids: list[int], decode_token: Any, token_bytes: Any, text_length: int) -> tuple[list[str], list[int]]:
    """``logprobs.tokens`` and ``text_offset`` of a ``text_completion`` choice. A token holding part of a UTF-8
    character is named by its bytes (``bytes:\\xe4\\xbb``, as OpenAI names it; decoded alone it is U+FFFD); each offset
    is the index in the choice's text of the character the token's first byte belongs to, counted over the tokens'
    bytes as the text was decoded (UTF-8, a malformed sequence one U+FFFD: a continuation byte continues an open
    character, and a stray one is a character of its own), never past the text (tokens after a stop string's cut)."""
    tokens, offsets = [], []
    decoder, emitted = codecs.getincrementaldecoder("utf-8")("replace"), 0  # emitted: characters decoded so far
    for t in ids:
        raw = token_bytes(t)
        try:
            raw.decode("utf-8")
            tokens.append(decode_token(t))
        except UnicodeDecodeError:
            tokens.append("bytes:" + "".join(f"\\x{b:02x}" for b in raw))
        pending = decoder.getstate()[0]  # the bytes of a character not complete yet
        first = len((pending + raw[:1]).decode("utf-8", "replace")) - 1 if raw else 0  # its first byte's character
        offsets.append(min(emitted + first, text_length))
        emitted += len(decoder.decode(raw))
    return tokens, offsets


def completion_response(
    call: SampledCall, req: CompletionRequest, response_id: str, decode_token: Any = str, token_bytes: Any = None
) -> dict[str, Any]:
    """A ``text_completion`` object (``logprobs``: 0 gives the sampled tokens' logprobs); ``decode_token(id)`` names tokens,
    ``token_bytes(id)`` gives their bytes (None: the UTF-8 of ``decode_token(id)``)."""
    token_bytes = token_bytes or (lambda t: decode_token(t).encode())
    choices = []
    for choice in call.choices:
        logprobs = None
        if req.logprobs is not None:
            tokens, offsets = _completion_tokens(choice.completion_ids, decode_token, token_bytes, len(choice.text))
            logprobs = {"tokens": tokens, "token_logprobs": choice.logprobs, "top_logprobs": None, "text_offset": offsets}
        entry: dict[str, Any] = {"index": choice.index, "text": choice.text, "finish_reason": choice.finish_reason, "logprobs": logprobs}
        choices.append(entry)
    return _response_body("text_completion", call, req, response_id, choices)


def models_response(model_name: str, created: int, max_context: int) -> dict[str, Any]:
    """``GET /v1/models``: the one model this server serves."""
    return {
        "object": "list",
        "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "nemo_like", "max_model_len": max_context}],
    }
