"""The arithmetic environment: exact-match integer answers (or a user reward by import path)."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

from nemo_like.config.errors import ConfigError
from nemo_like.distributed.worker_group import RoleResources, WorkerResources
from nemo_like.environments.arithmetic_reward import score_response
from nemo_like.environments.interface import EnvironmentInterface

RewardFn = Callable[[str, Any], float]


ENV_WORKER_CPUS = 0.1  # scoring is cheap: a small reservation per reward actor


def environment_resources(cfg) -> RoleResources:
    """``env.num_workers`` reward actors, a small CPU reservation each."""
    return RoleResources("environment", cfg.env.num_workers, WorkerResources(num_cpus=ENV_WORKER_CPUS))


def import_reward_fn(path: str) -> RewardFn:
    """Import ``'package.module:function'``; errors name the path and what was expected."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"env.custom_reward_fn must look like 'module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"env.custom_reward_fn: cannot import module '{module_name}': {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"env.custom_reward_fn: '{module_name}' has no callable '{attr}'")
    return fn


class ArithmeticEnvironment(EnvironmentInterface):
    """Scores responses against ``metadata['answer']``."""

    def __init__(self, rank: int = 0, world_size: int = 1, custom_reward_fn: str | None = None) -> None:
        self.reward_fn: RewardFn = import_reward_fn(custom_reward_fn) if custom_reward_fn else score_response

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        rewards = [float(self.reward_fn(text, meta["answer"])) for text, meta in zip(responses, metadata)]
        bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
        if bad:
            raise ValueError(f"reward function returned non-finite rewards for responses {bad[:10]}")
        return rewards
