"""The math environment: the response's final answer checked symbolically against the gold answer
with `math-verify <https://github.com/huggingface/Math-Verify>`_.

Extraction (math-verify's defaults): a ``\\boxed{...}`` answer first, else the last LaTeX expression,
else the last plain expression or number ("the answer is X" first); several different bare boxed answers are read as
one set (a self-corrected response is wrong), boxes inside ``$...$`` as the last one (docs/guides/data-and-environments.md). Comparison is symbolic: ``0.5``, ``1/2`` and ``\\frac{1}{2}``
are equal; so are ``\\{1,2\\}`` and ``\\{2,1\\}``; intervals, negative numbers and equations (``x=5``
against ``5``) are handled. The gold answer is ``metadata["answer"]`` (a LaTeX string or a number).

Reward: 1.0 for a correct answer; otherwise ``format_reward`` when the response put an answer in
``\\boxed{}``, else 0.0. Each check runs in a helper process with a hard time limit
(:mod:`nemo_like.environments.math_verify_process`); a timed-out, crashed or unparsable answer scores
like a wrong one (the format reward still applies) and is counted in :meth:`MathEnvironment.metrics`.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from nemo_like.config.types import Float, Int
from nemo_like.environments.interface import EnvironmentInterface
from nemo_like.environments.math_verify_process import MathVerifyProcess, closed_boxes

_NON_SPACE = re.compile(r"\S")
#: Counters reported by :meth:`MathEnvironment.metrics` (every key, every call).
COUNTERS = ("timeouts", "parse_failures", "gold_parse_failures", "crashes", "correct")


class MathEnvConfig(BaseModel):
    """Keys of a math environment's section (``env.math``, or any section with ``class: math``)."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: Float = Field(
        5.0, gt=0, description="Per-answer time limit for parsing and verifying; the checker process is killed and restarted past it."
    )
    format_reward: Float = Field(
        0.0, ge=0, lt=1, description="Reward for a wrong answer given in \\boxed{} (below 1, so only correct answers count as correct)."
    )
    memory_mb: Int = Field(
        2048,
        ge=256,
        description="Address-space limit of the checker process (RLIMIT_AS): a check that needs more (a 12-character "
        "\\boxed{2^{2^{33}}+1} took ~0.5 GB within its time limit) fails inside the checker: math-verify turns the MemoryError "
        "into a failed parse (reward 0); one that reaches the checker's loop ends the process as a counted crash, and a fresh "
        "one checks the next answer.",
    )


def has_boxed_answer(response: str) -> bool:
    """Whether the response holds a whole ``\\boxed{...}`` (or ``\\fbox{...}``) answer: a box that closes (its braces
    balance) with something in it. An empty box, or one a length limit cut before its closing brace (``\\boxed{1``), had
    earned the format reward."""
    # one pass over the braces (a scan per box took 35 s in the actor on 64,000 characters of unclosed boxes)
    return any(_NON_SPACE.search(response, start, end) for start, end in closed_boxes(response))


class MathEnvironment(EnvironmentInterface):
    """See the module docstring. One helper process per instance, started on the first answer."""

    config_model = MathEnvConfig

    def __init__(self, timeout_s: float = 5.0, format_reward: float = 0.0, memory_mb: int = 2048) -> None:
        self.format_reward = format_reward
        self.checker = MathVerifyProcess(timeout_s, memory_mb=memory_mb)
        self._counts = dict.fromkeys(COUNTERS, 0.0)

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        rewards = []
        for response, meta in zip(responses, metadata):
            status = self.checker.check(response, meta["answer"])
            key = {
                "timeout": "timeouts",
                "parse_failure": "parse_failures",
                "gold_parse_failure": "gold_parse_failures",
                "crash": "crashes",
                "correct": "correct",
            }.get(status)
            if key is not None:
                self._counts[key] += 1
            if status == "correct":
                rewards.append(1.0)
            else:
                rewards.append(self.format_reward if self.format_reward and has_boxed_answer(response) else 0.0)
        return rewards

    def metrics(self) -> dict[str, float]:
        counts, self._counts = self._counts, dict.fromkeys(COUNTERS, 0.0)
        return counts

    def close(self) -> None:
        """Stop the helper process."""
        self.checker.close()
