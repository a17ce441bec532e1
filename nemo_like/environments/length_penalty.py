"""The length-penalty environment (``class: length_penalty``), a reward source for composition: a response longer
than ``free_length`` (characters or words) loses ``penalty_per_unit`` per unit beyond it, at most ``max_penalty``:
``reward = -min(max_penalty, penalty_per_unit * max(0, length - free_length))`` (0 or negative).

Counters: ``over_length`` (responses past ``free_length``), ``length_sum`` (their lengths in ``unit``s, all responses).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from nemo_like.config.types import Float, Int
from nemo_like.environments.interface import EnvironmentInterface


class LengthPenaltyConfig(BaseModel):
    """Keys of a length-penalty section or source."""

    model_config = ConfigDict(extra="forbid")

    free_length: Int = Field(0, ge=0, description="Length with no penalty.")
    penalty_per_unit: Float = Field(0.01, gt=0, description="Penalty per character / word beyond free_length.")
    max_penalty: Float = Field(1.0, gt=0, description="Largest penalty (the reward is at least -max_penalty).")
    unit: Literal["chars", "words"] = Field("chars", description="Count characters or whitespace-separated words.")


class LengthPenaltyEnvironment(EnvironmentInterface):
    """See the module docstring."""

    config_model: ClassVar[type[BaseModel]] = LengthPenaltyConfig

    def __init__(self, **settings: Any) -> None:
        self.cfg = LengthPenaltyConfig.model_validate(settings)
        self._counts = {"over_length": 0.0, "length_sum": 0.0}

    def length(self, response: str) -> int:
        """The response's length in the configured unit."""
        return len(response.split()) if self.cfg.unit == "words" else len(response)

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        rewards = []
        for response in responses:
            n = self.length(response)
            self._counts["length_sum"] += n
            excess = max(0, n - self.cfg.free_length)
            self._counts["over_length"] += float(excess > 0)
            rewards.append(-min(self.cfg.max_penalty, self.cfg.penalty_per_unit * excess))
        return rewards

    def metrics(self) -> dict[str, float]:
        counts, self._counts = self._counts, {"over_length": 0.0, "length_sum": 0.0}
        return counts
