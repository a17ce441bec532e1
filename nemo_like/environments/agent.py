"""``env.<task>: {class: agent, agent: "my_pkg.agents:solve", ...}``: the task is rolled out by the user's own agent.

The run (``nemo_like/experience/agent_rollouts.py``) calls the agent function once per sample, on the driver, with
``(base_url, api_key, session_id, prompt, metadata)``: an OpenAI-compatible server sampling from the model being
trained (``nemo_like/serving/``), the session the calls must name, the prompt's chat messages and its metadata. The
function (sync or ``async``) returns either a reward (a number) or the messages of its episode (a list of OpenAI-style
messages, or the final answer as a string), which the task's ``verifier`` scores. This class holds the settings and
the function, and, in its environment actor, scores returned messages with the verifier
(``docs/guides/agents.md``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from nemo_like.config.errors import ConfigError
from nemo_like.config.types import Float, Int
from nemo_like.environments.interface import ActorNeeds, EnvironmentInterface
from nemo_like.environments.registry import ENVIRONMENTS, check_constructor_kwargs
from nemo_like.utils.imports import import_object

#: Failure kinds counted as ``agent/failures/<kind>``.
FAILURE_KINDS = ("error", "deadline", "budget", "bad_return", "rejected")


class AgentConfig(BaseModel):
    """The ``env.<task>`` section of an agent task (besides ``class`` and ``num_workers``)."""

    model_config = ConfigDict(extra="forbid")

    agent: str = Field(description="The agent function, 'package.module:function' or 'path/to/file.py:function'.")
    verifier: str | None = Field(
        None, description="Environment scoring returned messages: a built-in name ('tool', 'arithmetic', 'math', ...) or 'module:Class'."
    )
    verifier_kwargs: dict[str, Any] = Field(default_factory=dict, description="The verifier's own settings.")
    max_concurrency: Int = Field(16, ge=1, description="Sessions running at once.")
    deadline_s: Float = Field(60.0, gt=0, description="Seconds a session may run; past it the session fails ('deadline').")
    max_tokens_per_session: Int = Field(
        1024,
        ge=1,
        description="Sampled tokens a session may use: the server cuts the call that reaches them and refuses a call that"
        " finds fewer left than its n (400 session_budget_exceeded); an agent that raises after that fails ('budget').",
    )
    failure_reward: Float = Field(0.0, description="Reward of a failed session's rows.")
    seeded_calls: bool = Field(
        True,
        description="Sample every call with its own seed (utils/seeds.py agent_call_seed): reproducible, and still batched"
        " with other sessions' calls (one seed per prompt).",
    )


@dataclass(frozen=True)
class AgentSettings:
    """An agent task's settings and its function, as the driver runs them."""

    task: str
    config: AgentConfig
    function: Callable[..., Any]

    @property
    def is_async(self) -> bool:
        """Whether the agent is a coroutine function, called on the event loop: an ``async def``, one under a
        ``functools.wraps`` decorator, or an object with an ``async def __call__`` (others run on a thread)."""
        function = inspect.unwrap(self.function)
        call = None if inspect.isroutine(function) else type(function).__call__  # a callable object's own method
        return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


def load_agent_settings(task: str, kwargs: dict[str, Any]) -> AgentSettings:
    """Validate ``env.<task>``'s settings and import its agent function (and check its verifier) in the driver.

    Raises:
        ConfigError: naming ``env.<task>.agent`` or ``env.<task>.verifier`` and what was expected."""
    config = AgentConfig.model_validate(kwargs)
    where = f"env.{task}.agent"
    try:
        function = import_object(config.agent)
    except (ValueError, ImportError) as exc:
        raise ConfigError(
            f"{where}: cannot import {config.agent!r} ({exc}); expected 'package.module:function' or 'path/to/file.py:function'"
        ) from None
    if not callable(function):
        raise ConfigError(f"{where}: {config.agent!r} is a {type(function).__name__}, not a function")
    params = inspect.signature(function).parameters
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 5 and not any(p.kind is p.VAR_POSITIONAL for p in params.values()):
        raise ConfigError(f"{where}: {config.agent!r} must accept (base_url, api_key, session_id, prompt, metadata)")
    if config.verifier is not None:
        verifier = ENVIRONMENTS.get(config.verifier, f"env.{task}.verifier")
        check_constructor_kwargs(verifier, config.verifier_kwargs, f"env.{task}.verifier_kwargs")
    return AgentSettings(task, config, function)


class AgentEnvironment(EnvironmentInterface):
    """The environment actor of an agent task: scores the final answers of returned messages with the verifier."""

    config_model = AgentConfig

    @classmethod
    def answer_problem(cls, settings: dict[str, Any], answer: Any) -> str | None:
        """The verifier's problem with the answer (it scores the final answers); none without a verifier."""
        verifier = settings.get("verifier")
        if verifier is None:
            return None
        problem = ENVIRONMENTS.get(verifier, "env.<task>.verifier").answer_problem(dict(settings.get("verifier_kwargs") or {}), answer)
        return None if problem is None else f"{problem}, for the verifier '{verifier}'"

    @classmethod
    def actor_needs(cls, settings: dict[str, Any]) -> ActorNeeds:
        """The verifier's (it runs in this actor: a reward model's GPU, a judge's engine actors), CPU at least the
        default's; the default without a verifier."""
        verifier = settings.get("verifier")
        if verifier is None:
            return ActorNeeds()
        verifier_cls = ENVIRONMENTS.get(verifier, "env.<task>.verifier")
        needs = verifier_cls.actor_needs(
            check_constructor_kwargs(verifier_cls, settings.get("verifier_kwargs") or {}, "env.<task>.verifier_kwargs")
        )
        return replace(needs, num_cpus=max(ActorNeeds().num_cpus, needs.num_cpus))

    @classmethod
    def config_warnings(cls, task: str, settings: dict[str, Any], max_rollout_turns: int) -> list[str]:
        """``verifier_kwargs`` set without a ``verifier``: nothing reads them; with one, the verifier's own lines (named
        ``env.<task>.verifier_kwargs.<key>``)."""
        verifier = settings.get("verifier")
        if verifier is None:
            if settings.get("verifier_kwargs"):
                return [f"env.{task}.verifier_kwargs has no effect: env.{task}.verifier is not set (the kwargs are the verifier's)"]
            return []
        verifier_cls = ENVIRONMENTS.get(verifier, "env.<task>.verifier")
        return verifier_cls.config_warnings(f"{task}.verifier_kwargs", settings.get("verifier_kwargs") or {}, max_rollout_turns)

    def __init__(self, **settings: Any) -> None:
        self.config = AgentConfig.model_validate(settings)
        self.verifier: EnvironmentInterface | None = None
        if self.config.verifier is not None:
            cls = ENVIRONMENTS.get(self.config.verifier, "env.<task>.verifier")
            self.verifier = cls(**check_constructor_kwargs(cls, self.config.verifier_kwargs, "env.<task>.verifier_kwargs"))

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        """The verifier's reward of each final answer (an agent task without a verifier must return rewards)."""
        if self.verifier is None:
            raise ValueError("this agent task has no verifier (env.<task>.verifier), so its agent must return a reward")
        return self.verifier.score(responses, metadata)

    def metrics(self) -> dict[str, float]:
        return self.verifier.metrics() if self.verifier is not None else {}

    def close(self) -> None:
        close = getattr(self.verifier, "close", None)
        if callable(close):
            close()


class ContentError(ValueError):
    """An OpenAI message ``content`` that is not text: ``kind`` is ``"type"`` (neither a string, a list of parts nor
    null) or ``"part"`` (a part that is not ``{"type": "text", "text": str}``)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def content_text(content: Any) -> str:
    """The text of an OpenAI message's ``content``: a string as is, null as "", a list of text parts
    (``[{"type": "text", "text": ...}]``) joined. The rollout server renders request messages with it too.

    Raises:
        ContentError: another type, or a part that is not a text part (an image, say)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ContentError(f"only text content parts ({{'type': 'text', 'text': ...}}) are read, got {part!r:.80}", "part")
        return "".join(part["text"] for part in content)
    raise ContentError(f"content must be a string, a list of text parts or null, got {type(content).__name__}", "type")


def final_answer(messages: Any) -> str:
    """The text to verify from what an agent returned: a string as is, else the last assistant message's content
    (:func:`content_text`: a list of text parts is joined).

    Raises:
        TypeError: ``messages`` is neither a string nor a list of messages, or the content is not text."""
    if isinstance(messages, str):
        return messages
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"an agent must return a reward, a string or a list of messages, got {type(messages).__name__}")
    for message in reversed(messages):
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
        if role == "assistant":
            content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
            try:
                return content_text(content)
            except ContentError as exc:
                raise TypeError(f"the last assistant message's {exc}") from None
    return ""
