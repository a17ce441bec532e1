"""The arithmetic environment: exact-match integer answers (or a user reward function by import path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nemo_like.environments.arithmetic_reward import not_an_integer, score_response
from nemo_like.environments.interface import EnvironmentInterface, as_number
from nemo_like.utils.registry import PluginNameError, Registry

RewardFn = Callable[[str, Any], float]


def _check_reward_fn(fn: object, path: str, key: str) -> None:
    if not callable(fn):
        raise PluginNameError(key, f"{key}: {path!r} is a {type(fn).__name__}, not a function (response_text, answer) -> float")


#: Reward functions (``custom_reward_fn``, the tool environment's ``answer_checker``): user code by import path.
REWARD_FUNCTIONS: Registry[RewardFn] = Registry(
    "reward function",
    "custom_reward_fn",
    validate=_check_reward_fn,
    unknown=lambda path, key, _names: f"{key} must look like 'module:function', got {path!r}",
)


def import_reward_fn(path: str, key: str = "custom_reward_fn") -> RewardFn:
    """Import ``'package.module:function'``; errors name the key and what was expected."""
    return REWARD_FUNCTIONS.get(path, key)


class ArithmeticEnvConfig(BaseModel):
    """Keys of an arithmetic environment's section (``env.arithmetic``)."""

    model_config = ConfigDict(extra="forbid")

    custom_reward_fn: str | None = Field(
        None, description="Optional 'module:function' with signature (response_text, answer) -> float replacing the built-in reward."
    )

    @field_validator("custom_reward_fn")
    @classmethod
    def _importable(cls, path: str | None) -> str | None:
        if path is not None:
            import_reward_fn(path)  # fail in the driver, not inside an actor
        return path


class ArithmeticEnvironment(EnvironmentInterface):
    """Scores responses against ``metadata['answer']`` (an int) with :func:`score_response`."""

    config_model = ArithmeticEnvConfig

    @classmethod
    def answer_problem(cls, settings: dict[str, Any], answer: Any) -> str | None:
        """The built-in reward compares integers; a ``custom_reward_fn`` takes any answer."""
        if settings.get("custom_reward_fn"):
            return None
        return not_an_integer(answer, "the built-in reward compares integers; set custom_reward_fn for other answers")

    def __init__(self, custom_reward_fn: str | None = None) -> None:
        self.reward_fn: RewardFn = import_reward_fn(custom_reward_fn) if custom_reward_fn else score_response
        self.reward_fn_name = f"custom_reward_fn {custom_reward_fn!r}" if custom_reward_fn else "the built-in reward"

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return [as_number(self.reward_fn(text, meta["answer"]), self.reward_fn_name, "reward") for text, meta in zip(responses, metadata)]
