"""The ``teacher`` and ``distillation`` sections: on-policy distillation from a teacher model.

The student (the policy) samples; the teacher scores the student's sampled tokens (a frozen copy of another model,
sharded like the reference); each sampled token's advantage gets ``distillation.advantage_weight x (log pi_T(x_t) -
log pi_S(x_t))`` (stop-gradient: the per-token reverse-KL signal), added to the task reward's advantage scaled by
``distillation.task_advantage_weight``. docs/guides/distillation.md has the derivation and the metrics.
"""

from __future__ import annotations

from pydantic import Field, model_validator

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
    by_task: dict[str, str | None] = Field(
        default_factory=dict,
        description="Several teachers: task name -> teacher model for that task's samples (null: no teacher for it); tasks "
        "not listed take teacher.model_name (null there: no teacher signal). Every teacher shares the student's tokenizer.",
    )

    @model_validator(mode="after")
    def _by_task_names(self) -> TeacherConfig:
        if self.by_task and self.tokenizer_name is not None:
            raise ValueError("teacher.tokenizer_name applies to teacher.model_name only; with teacher.by_task each teacher uses its own")
        return self

    @property
    def enabled(self) -> bool:
        """Whether any sample has a teacher."""
        return self.model_name is not None or any(m is not None for m in self.by_task.values())

    def models(self) -> list[str]:
        """Every distinct teacher model, in a fixed order (teacher.model_name first)."""
        names = [self.model_name, *self.by_task.values()]
        return list(dict.fromkeys(n for n in names if n is not None))

    def model_for(self, task: str) -> str | None:
        """The teacher of ``task``'s samples (``None``: none)."""
        return self.by_task[task] if task in self.by_task else self.model_name


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
