"""The ``teacher`` and ``distillation`` sections: on-policy distillation from a teacher model.

The student (the policy) samples; the teacher scores the student's sampled tokens (a frozen copy of another model,
sharded like the reference); each sampled token's advantage gets ``distillation.advantage_weight x (log pi_T(x_t) -
log pi_S(x_t))`` (stop-gradient: the per-token reverse-KL signal), added to the task reward's advantage scaled by
``distillation.task_advantage_weight``. docs/guides/distillation.md has the derivation and the metrics.
"""

from __future__ import annotations

from pydantic import Field

from nemo_like.config.sections.base import Section
from nemo_like.config.types import Float


class TeacherConfig(Section):
    model_name: str | None = Field(
        None,
        description="The teacher: HF model id or local directory ('embedded:tiny-arith-teacher' is the shipped one); null: no "
        "teacher (no actors start). Its tokenizer must equal the student's.",
    )
    tokenizer_name: str | None = Field(None, description="The teacher's tokenizer; defaults to teacher.model_name.")
    precision: str | None = Field(None, description="The teacher's precision (float32 or bfloat16); null: policy.precision.")


class DistillationConfig(Section):
    advantage_weight: Float = Field(
        1.0,
        ge=0,
        description="Weight of the per-token teacher signal sg(log pi_T - log pi_S) added to every sampled token's advantage.",
    )
    task_advantage_weight: Float = Field(
        1.0,
        ge=0,
        description="Weight of the task reward's advantage (0: distil from the teacher alone, no task reward).",
    )
