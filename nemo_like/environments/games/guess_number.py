"""Guess-the-number (built-in ``guess_number``): the model guesses, the environment says higher or lower.

The secret is ``metadata["answer"]`` (an int, or text holding one; the prompt sets come from
:mod:`nemo_like.data.multiturn_tasks`), so a step is a pure function of the conversation and the metadata.
Per step and sample, the model's latest turn must be one integer (the arithmetic task's parsing rule,
:func:`~nemo_like.environments.arithmetic_reward.extract_integer`):

* the secret: reward 1.0, terminated;
* another integer: observation ``{"role": "user", "content": "higher"}`` (the secret is larger) or ``"lower"``,
  reward 0, not terminated; the guess count in ``metadata["guesses"]`` goes up by one, and once it reaches
  ``max_guesses`` the episode terminates with reward 0 (feedback is not sent then);
* not an integer: terminated, reward 0 (counted as ``malformed``).

A wrong guess in the sample's final turn (``metadata[FINAL_TURN]``: ``grpo.max_rollout_turns`` reached, the turn
cut by its budget, or no room left for another turn in ``policy.max_total_sequence_length``) is counted as
``turn_limit``: the run ends the game unsolved there, before ``max_guesses``. A guess cut mid-number by the length
limit is read as the digits that are left (``57`` cut to ``5`` is a guess of 5): the cut is not seen here. A recipe whose
``grpo.max_rollout_turns`` is below ``max_guesses`` gets a start-up warning.

A binary search finds any secret in ``low..high`` within ``ceil(log2(high - low + 2))`` guesses.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from nemo_like.config.types import Int
from nemo_like.environments.arithmetic_reward import extract_integer, integer_answer, not_an_integer
from nemo_like.environments.interface import FINAL_TURN, EnvironmentInterface, EnvironmentStep

COUNTERS = ("guesses", "solved", "malformed", "out_of_guesses", "turn_limit")


class GuessNumberConfig(BaseModel):
    """Keys of a guess-the-number environment's section (``env.<task>`` with ``class: guess_number``)."""

    model_config = ConfigDict(extra="forbid")

    max_guesses: Int = Field(7, ge=1, description="Guesses allowed per game; the game ends unsolved after this many.")
    feedback_role: str = Field("user", min_length=1, description="Role of the higher/lower message (the chat template must know it).")


def secret_of(meta: dict[str, Any]) -> int:
    """The game's secret number (``metadata["answer"]``)."""
    answer = meta["answer"]
    value = integer_answer(answer)
    if value is None:
        raise ValueError(f"guess_number: metadata['answer'] must be an integer, got {answer!r}")
    return value


class GuessNumberEnvironment(EnvironmentInterface):
    """See the module docstring."""

    config_model = GuessNumberConfig

    @classmethod
    def answer_problem(cls, settings: dict[str, Any], answer: Any) -> str | None:
        """The answer is the secret number."""
        return not_an_integer(answer, "the game's secret number")

    @classmethod
    def reply_roles(cls, settings: dict[str, Any]) -> tuple[str, ...]:
        """``feedback_role``'s (a user's by default)."""
        return (settings.get("feedback_role", "user"),)

    @classmethod
    def config_warnings(cls, task: str, settings: dict[str, Any], max_rollout_turns: int) -> list[str]:
        """``max_guesses`` above ``grpo.max_rollout_turns``: the turn limit ends the games first."""
        max_guesses = GuessNumberConfig.model_validate(settings).max_guesses
        if max_guesses <= max_rollout_turns:
            return []
        return [
            f"env.{task}.max_guesses={max_guesses} has no effect beyond grpo.max_rollout_turns={max_rollout_turns}: games end "
            f"unsolved at the turn limit first (counted in env/{task}/turn_limit); set grpo.max_rollout_turns >= {max_guesses}"
        ]

    def __init__(self, max_guesses: int = 7, feedback_role: str = "user") -> None:
        self.max_guesses, self.feedback_role = max_guesses, feedback_role
        self._counts = dict.fromkeys(COUNTERS, 0.0)

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        """Single-turn use: 1.0 for guessing the secret at the first try (the only turn is the final one: a wrong guess
        counts in ``turn_limit``)."""
        final = [{**meta, FINAL_TURN: True} for meta in metadata]
        return [step.reward for step in self.step([[{"role": "assistant", "content": r}] for r in responses], final)]

    def step(self, message_logs: list[list[dict[str, str]]], metadata: list[dict[str, Any]]) -> list[EnvironmentStep]:
        return [self._one(log[-1]["content"] if log else "", meta) for log, meta in zip(message_logs, metadata)]

    def _one(self, text: str, meta: dict[str, Any]) -> EnvironmentStep:
        guess = extract_integer(text)
        if guess is None:
            self._counts["malformed"] += 1
            return EnvironmentStep(0.0, terminated=True)
        self._counts["guesses"] += 1
        guesses = int(meta.get("guesses", 0)) + 1
        updated = {**meta, "guesses": guesses}
        secret = secret_of(meta)
        if guess == secret:
            self._counts["solved"] += 1
            return EnvironmentStep(1.0, terminated=True, metadata=updated)
        if guesses >= self.max_guesses:
            self._counts["out_of_guesses"] += 1
            return EnvironmentStep(0.0, terminated=True, metadata=updated)
        if meta.get(FINAL_TURN):  # the run ends the game here: no hint would be read
            self._counts["turn_limit"] += 1
            return EnvironmentStep(0.0, terminated=False, metadata=updated)
        hint = "higher" if secret > guess else "lower"
        return EnvironmentStep(0.0, terminated=False, observation={"role": self.feedback_role, "content": hint}, metadata=updated)

    def metrics(self) -> dict[str, float]:
        counts, self._counts = self._counts, dict.fromkeys(COUNTERS, 0.0)
        return counts
