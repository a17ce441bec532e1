"""Answers in OpenAI's JSON shapes (``chat.completion``, ``text_completion``, the model list)."""

from __future__ import annotations

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


def completion_response(call: SampledCall, req: CompletionRequest, response_id: str, decode_token: Any = str) -> dict[str, Any]:
    """A ``text_completion`` object (``logprobs``: 0 gives the sampled tokens' logprobs)."""
    choices = []
    for choice in call.choices:
        logprobs = None
        if req.logprobs is not None:
            tokens = [decode_token(t) for t in choice.completion_ids]
            offsets, at = [], 0
            for token in tokens:
                offsets.append(at)
                at += len(token)
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
