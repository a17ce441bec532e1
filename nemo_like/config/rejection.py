"""Configuration of rollout rejection masks (``grpo.rollout_rejection``).

Tokens or whole sequences whose generation/training mismatch is out of bounds are removed from the
loss mask on the driver, before the global token and sequence counts are made; see
:mod:`nemo_like.algorithms.rejection` and ``docs/guides/grpo.md`` ("Rollout rejection masks").
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_like.config.types import Float

RATIO_STATISTICS = ("sum", "mean", "max")
KL_STATISTICS = ("k1", "k2", "k3")


class RolloutRejectionConfig(BaseModel):
    """Reject tokens / sequences by the ratio pi_prev/pi_gen (or a per-sequence mismatch statistic)."""

    model_config = ConfigDict(extra="forbid")

    level: Literal["token", "sequence"] | None = Field(
        None,
        description=(
            "null: off. 'token': drop each response token whose ratio pi_prev/pi_gen is outside "
            "[lower, upper]. 'sequence': drop whole samples whose sequence_statistic is outside "
            "[lower, upper]. Dropped tokens/samples leave the loss mask and the global token and "
            "sequence counts (unlike TIS/icepop weights of 0). Needs the prev-logprob pass."
        ),
    )
    sequence_statistic: Literal["sum", "mean", "max", "k1", "k2", "k3"] = Field(
        "mean",
        description=(
            "Per-sequence statistic for level 'sequence' (L = the sequence's log-ratios "
            "log pi_prev - log pi_gen over its response tokens): 'sum' = exp(sum L), the "
            "sequence-level IS ratio; 'mean' = exp(mean L), the geometric-mean ratio; 'max' = "
            "token veto: rejected when any token ratio exceeds upper or falls below lower; "
            "'k1'/'k2'/'k3' = mean over tokens of that estimator of KL(pi_gen || pi_prev), "
            "bounds on the KL value itself."
        ),
    )
    lower: Float | None = Field(
        None,
        description=("Lower bound (inclusive); null: none. For the ratio statistics (token, sum, mean, max) a ratio > 0, e.g. 0.5."),
    )
    upper: Float | None = Field(
        None,
        description="Upper bound (inclusive); null: none. e.g. 2.0 for ratios, 0.01 for k3.",
    )

    @property
    def enabled(self) -> bool:
        return self.level is not None

    @property
    def bounds_ratio(self) -> bool:
        """Whether the bounds are on a ratio (token level or a ratio statistic), not a KL value."""
        return self.level == "token" or self.sequence_statistic in RATIO_STATISTICS

    @model_validator(mode="after")
    def _check(self) -> RolloutRejectionConfig:
        key = "grpo.rollout_rejection"
        problems = []
        if self.enabled and self.lower is None and self.upper is None:
            problems.append(f"{key}.level={self.level!r} needs {key}.lower and/or {key}.upper")
        if self.lower is not None and self.upper is not None and self.lower >= self.upper:
            problems.append(f"{key}.lower ({self.lower}) must be below {key}.upper ({self.upper})")
        if self.enabled and self.bounds_ratio:
            for name in ("lower", "upper"):
                value = getattr(self, name)
                if value is not None and value <= 0:
                    problems.append(f"{key}.{name} ({value}) must be > 0: it bounds a ratio pi_prev/pi_gen")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def no_effect_warnings(self) -> list[str]:
        """Options set (changed from the default) that the other options make ineffective."""
        key = "grpo.rollout_rejection"
        warnings = []
        if not self.enabled:
            for name in ("lower", "upper"):
                if getattr(self, name) is not None:
                    warnings.append(f"{key}.{name} has no effect because {key}.level is null (ignored)")
        if self.level != "sequence" and self.sequence_statistic != "mean":
            warnings.append(
                f"{key}.sequence_statistic has no effect because {key}.level is "
                f"{'null' if self.level is None else repr(self.level)} (ignored)"
            )
        return warnings
