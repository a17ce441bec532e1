"""Request bodies the server accepts (OpenAI's fields, checked), and the engine's sampling settings they ask for.

Unknown fields are refused (400 ``Unrecognized request argument``), as OpenAI does, and so are known fields this
server does not implement when set to anything but their no-op value (``stream``, penalties, ``logit_bias``, ...):
an agent must not believe a setting took effect when it did not. Extension fields: ``top_k`` and
``return_token_ids`` (the answer then carries ``prompt_token_ids`` and, per choice, ``completion_token_ids`` and
``completion_logprobs``).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nemo_like.models.generation.interface import SamplingParams
from nemo_like.serving.errors import bad_request, unsupported


def engine_top_k(top_k: int | None) -> int | None:
    """A request's ``top_k`` as the engine takes it: -1, 0 or unset is off (``None``)."""
    return top_k if top_k and top_k > 0 else None


#: Temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``).
GREEDY_BELOW = 1e-5


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. Strict types, as OpenAI checks them: ``true`` is not a number and ``"7"`` not an
    integer (lax parsing had read ``max_tokens: true`` as 1 and answered with one token)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**62)  # choice j samples with seed + j: keep every one a valid engine seed
    user: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False

    @field_validator("n", mode="before")
    @classmethod
    def _null_n_is_one(cls, n: Any) -> Any:
        """``n: null`` is OpenAI's default, 1 (its schema allows null)."""
        return 1 if n is None else n

    def check_supported(self) -> None:
        """Raise a 400 for a set parameter this server does not implement."""
        if self.stream:
            raise unsupported("stream", "answers are returned whole")
        if self.stream_options is not None:
            raise unsupported("stream_options")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise unsupported(name, "it would change the distribution the logprobs are recorded under")
        if self.logit_bias:
            raise unsupported("logit_bias", "it would change the distribution the logprobs are recorded under")

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise bad_request("'stop' takes at most 4 strings.", param="stop")
        if any(not s for s in stops):
            raise bad_request("'stop' strings must not be empty.", param="stop")
        return tuple(stops)

    def sampling_params(self, max_new_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """The engine's settings: a temperature below :data:`GREEDY_BELOW` is greedy (as vLLM's sampler treats one; logits
        divided by 1e-38 overflowed to NaN logprobs: a 500, or a session rejected); ``top_k`` -1 or 0 means off."""
        temperature = 1.0 if self.temperature is None else self.temperature
        greedy = temperature < GREEDY_BELOW
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if greedy else temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=engine_top_k(self.top_k),
            greedy=greedy,
            stop_token_ids=stop_token_ids,
            stop_strings=self.stop_strings(),
        )


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: only a turn's first tool call is returned
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tool_choice not in (None, "auto", "none"):
            raise unsupported("tool_choice", "only 'auto' and 'none'")
        if self.top_logprobs:
            raise unsupported("top_logprobs", "only the sampled token's logprob is returned")
        if self.response_format not in (None, {"type": "text"}):
            raise unsupported("response_format", "only {'type': 'text'}")
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise bad_request(
                f"Set one of 'max_tokens' ({self.max_tokens}) and 'max_completion_tokens' ({self.max_completion_tokens}), "
                "not two different limits.",
                param="max_tokens",
            )
        for i, tool in enumerate(self.tools or []):
            try:  # the template writes the schema into the prompt: NaN or inf (1e400) there would read as a number
                json.dumps(tool, allow_nan=False)
            except (ValueError, TypeError, RecursionError):
                raise bad_request(f"'tools[{i}]' must hold JSON values (no NaN or Infinity).", param=f"tools[{i}]") from None
            function = tool.get("function") if isinstance(tool, dict) else None
            strict = function.get("strict") if isinstance(function, dict) else None
            if strict is not None and not isinstance(strict, bool):
                raise bad_request(f"'tools[{i}].function.strict' must be a boolean.", param=f"tools[{i}].function.strict")
            if strict:
                raise unsupported(f"tools[{i}].function.strict", "tool-call arguments are not constrained to the schema")
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise bad_request("'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice")
            if self.parallel_tool_calls is not None:
                raise bad_request("'parallel_tool_calls' is only allowed when 'tools' are specified.", param="parallel_tool_calls")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def parses_tools(self) -> bool:
        """Whether tool markup in the answer becomes ``tool_calls`` (tools offered, ``tool_choice`` not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is one string or one list of token ids."""

    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0)  # 0: each sampled token's logprob; more would ask for top alternatives
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise unsupported("echo")
        if self.suffix:
            raise unsupported("suffix")
        if self.best_of not in (None, 1):
            raise unsupported("best_of")
        if self.logprobs:
            raise unsupported("logprobs", "only 0: 'token_logprobs' holds each sampled token's logprob; no top alternatives")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("'prompt' must not be empty.", param="prompt")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens or 16  # OpenAI's default for completions
