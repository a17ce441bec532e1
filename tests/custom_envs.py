"""Environments for the tests, imported by path (``custom_envs:Name``) like a user's own module."""

from __future__ import annotations

from typing import Any

from nemo_like.environments.interface import EnvironmentInterface


class LengthParityEnv(EnvironmentInterface):
    """Reward ``bonus`` (default 0.25, a value the arithmetic environment never gives) for an even-length
    response, else -1.0; counts the responses it saw, so routing is visible in the metrics."""

    def __init__(self, bonus: float = 0.25) -> None:
        self.bonus = bonus
        self.seen = 0

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        self.seen += len(responses)
        return [self.bonus if len(r) % 2 == 0 else -1.0 for r in responses]

    def metrics(self) -> dict[str, float]:
        seen, self.seen = self.seen, 0
        return {"seen": float(seen)}


class NeedsThreshold(EnvironmentInterface):
    """A constructor argument without a default: the section must set it."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return [0.0 for _ in responses]


class NotAnEnvironment:
    """Has score() but does not subclass EnvironmentInterface."""

    def score(self, responses, metadata):
        return [0.0 for _ in responses]


class Unfinished(EnvironmentInterface):
    """Forgets to implement score()."""


class WrongLength(EnvironmentInterface):
    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return [0.0]


not_a_class = LengthParityEnv()


class FirstOfFour(EnvironmentInterface):
    """Reward 1.0 for every 4th response of a batch, else 0.0. With 4 samples per prompt, adjacent, scored
    by one actor (``num_workers: 1``), exactly the first sample of each prompt is correct: c = 1 of n = 4."""

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return [1.0 if i % 4 == 0 else 0.0 for i in range(len(responses))]
