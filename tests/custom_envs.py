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


class CountdownEnv(EnvironmentInterface):
    """A deterministic multi-turn environment: a sample's episode lasts ``1 + answer % turns`` model turns.
    Each non-final step answers with a ``{"role": observation_role, "content": "<n> left"}`` observation
    (and ``stop_strings`` for the next turn, when set); the final step rewards 1.0 when the gold answer
    appears in the model's last message. ``metadata["steps"]`` counts the steps taken; counters: steps;
    per-step metrics: ``observations`` (1 per observation given)."""

    def __init__(self, turns: int = 3, observation_role: str = "tool", stop_strings: list[str] | None = None) -> None:
        self.turns, self.role, self.stop_strings = turns, observation_role, stop_strings
        self.steps = 0

    @classmethod
    def reply_roles(cls, settings: dict[str, Any]) -> tuple[str, ...]:
        return (settings.get("observation_role", "tool"),)

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return [1.0 if str(m["answer"]) in r else 0.0 for r, m in zip(responses, metadata)]

    def step(self, message_logs, metadata):
        from nemo_like.environments.interface import EnvironmentStep

        out = []
        for log, meta in zip(message_logs, metadata):
            self.steps += 1
            done_steps = meta.get("steps", 0) + 1
            remaining = 1 + int(meta["answer"]) % self.turns - done_steps
            new_meta = {**meta, "steps": done_steps}
            if remaining <= 0:
                out.append(EnvironmentStep(self.score([log[-1]["content"]], [meta])[0], True, None, new_meta))
            else:
                obs = {"role": self.role, "content": f"{remaining} left"}
                out.append(EnvironmentStep(0.0, False, obs, new_meta, self.stop_strings, {"observations": 1.0}))
        return out

    def metrics(self) -> dict[str, float]:
        steps, self.steps = self.steps, 0
        return {"steps": float(steps)}


class NanForQuestionMarks(EnvironmentInterface):
    """A buggy reward: NaN for a response with a '?', else 0.0."""

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return [float("nan") if "?" in r else 0.0 for r in responses]


class CountsItsOwnSamples(EnvironmentInterface):
    """A reward of 1.0 that counts its calls under a name the run keeps for itself (``num_samples``)."""

    def __init__(self) -> None:
        self.samples = 0

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        self.samples += len(responses)
        return [1.0] * len(responses)

    def metrics(self) -> dict[str, float]:
        samples, self.samples = self.samples, 0
        return {"num_samples": float(samples), "scored": float(samples)}


class BuggyScorer(EnvironmentInterface):
    """Raises on a sample without an answer, returns None for one whose response says 'none', and reports a counter
    that is not a number when asked to."""

    def __init__(self, bad_counter: bool = False) -> None:
        self.bad_counter = bad_counter

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return [None if r == "none" else float(m["answer"] == r) for r, m in zip(responses, metadata)]

    def metrics(self) -> dict[str, float]:
        return {"scored": "many"} if self.bad_counter else {}


def reward_without_return(text: str, answer: Any) -> None:
    """A ``custom_reward_fn`` that forgets to return its reward."""
    float(text == str(answer))


class StringReplyRoles(CountdownEnv):
    """Declares its reply roles as a bare string (what ``("user")``, without its comma, is), not a tuple."""

    @classmethod
    def reply_roles(cls, settings: dict[str, Any]) -> tuple[str, ...]:
        return "user"  # type: ignore[return-value]  # the mistake under test
