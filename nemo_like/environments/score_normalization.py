"""Per-sample normalisation of learned scores (reward models, judges), configured as ``normalize: {...}``.

Every step maps one raw score to one reward on its own: no batch statistics, so a sample's reward never depends on
which other samples share its batch, how the batch was split over actors, or its order (GRPO normalises per
prompt group afterwards anyway). The steps, in order: ``(raw - shift) * scale``, then ``squash`` (``none``,
``sigmoid``, ``tanh``), then ``clip`` to ``[low, high]``.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_like.config.types import Float

#: The values each squash can return: a clip containing its range never binds.
SQUASH_RANGES = {"sigmoid": (0.0, 1.0), "tanh": (-1.0, 1.0)}


class ScoreNormalization(BaseModel):
    """How a raw score becomes a reward (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    shift: Float = Field(0.0, description="Subtracted from the raw score first.")
    scale: Float = Field(1.0, description="Multiplies the shifted score (must not be 0).")
    squash: Literal["none", "sigmoid", "tanh"] = Field("none", description="Squashing function after shift and scale.")
    clip: tuple[Float, Float] | None = Field(None, description="[low, high] bounds applied last; null: no clipping.")

    @model_validator(mode="after")
    def _consistent(self) -> ScoreNormalization:
        if self.scale == 0:
            raise ValueError("scale must not be 0 (every reward would be the same)")
        if not all(math.isfinite(v) for v in (self.shift, self.scale)):
            raise ValueError(f"shift and scale must be finite, got shift={self.shift}, scale={self.scale}")
        if self.clip is not None and not self.clip[0] < self.clip[1]:
            raise ValueError(f"clip must be [low, high] with low < high, got {list(self.clip)}")
        squashed = SQUASH_RANGES.get(self.squash)
        if self.clip is not None and squashed is not None and (self.clip[0] >= squashed[1] or self.clip[1] <= squashed[0]):
            constant = self.clip[0] if self.clip[0] >= squashed[1] else self.clip[1]
            raise ValueError(
                f"clip {list(self.clip)} lies outside squash '{self.squash}''s range {list(squashed)}: every reward would be {constant:g}"
            )
        if self.clip is not None and squashed is not None and self.clip[0] <= squashed[0] and self.clip[1] >= squashed[1]:
            warnings.warn(
                f"normalize.clip {list(self.clip)} has no effect: squash '{self.squash}' already keeps every reward in {list(squashed)}",
                UserWarning,
                stacklevel=2,
            )
        return self

    def __call__(self, raw: float) -> float:
        """The reward of one raw score."""
        if not math.isfinite(raw):  # an overflow, not a score: a squash or clip would make inf the top reward
            raise ValueError(f"the raw score is {raw} (the model or parser produced a non-finite score)")
        z = (raw - self.shift) * self.scale
        if self.squash == "sigmoid":
            z = 0.5 * (1.0 + math.tanh(0.5 * z))  # the logistic function, without overflow for large |z|
        elif self.squash == "tanh":
            z = math.tanh(z)
        if self.clip is not None:
            z = min(max(z, self.clip[0]), self.clip[1])
        if not math.isfinite(z):  # a finite score past float range after scale, with no squash or clip to bound it
            raise ValueError(f"score {raw} normalises to {z} (shift {self.shift}, scale {self.scale}); add a squash or a clip")
        return z
