"""The arithmetic environment: exact-match integer answers (or a user reward function by import path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nemo_like.config.errors import ConfigError
from nemo_like.environments.arithmetic_reward import score_response
from nemo_like.environments.interface import EnvironmentInterface
from nemo_like.utils.imports import import_object, is_import_path

RewardFn = Callable[[str, Any], float]


def import_reward_fn(path: str) -> RewardFn:
    """Import ``'package.module:function'``; errors name the key and what was expected."""
    if not is_import_path(path):
        raise ConfigError(f"custom_reward_fn must look like 'module:function', got {path!r}")
    try:
        fn = import_object(path)
    except ValueError as exc:
        raise ConfigError(f"custom_reward_fn: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"custom_reward_fn: {path!r} is a {type(fn).__name__}, not a function (response_text, answer) -> float")
    return fn


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

    def __init__(self, custom_reward_fn: str | None = None) -> None:
        self.reward_fn: RewardFn = import_reward_fn(custom_reward_fn) if custom_reward_fn else score_response

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return [float(self.reward_fn(text, meta["answer"])) for text, meta in zip(responses, metadata)]
