"""The environment contract: score responses, one reward per response."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from nemo_like.distributed.worker_group import Reinitializable


class EnvironmentInterface(Reinitializable, ABC):
    """A reward function behind a Ray actor. Rewards are floats; the arithmetic task uses 0/1."""

    @abstractmethod
    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        """Reward of ``responses[i]`` given the prompt's ``metadata[i]``."""
