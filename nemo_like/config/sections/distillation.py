"""The ``teacher`` and ``distillation`` sections: on-policy distillation from a teacher model.

The student (the policy) samples; the teacher scores the student's sampled tokens (a frozen copy of another model,
sharded like the reference); each sampled token's advantage gets ``distillation.advantage_weight x (log pi_T(x_t) -
log pi_S(x_t))`` (stop-gradient: the per-token reverse-KL signal), added to the task reward's advantage scaled by
``distillation.task_advantage_weight``. ``distillation.kl_weight > 0`` adds a token-level KL loss term to the teacher
(:mod:`nemo_like.models.teacher_kl`: forward or reverse, over the full vocabulary or a top-k support), computed in the
policy worker against a frozen copy of the teacher. docs/guides/distillation.md has the derivation and the metrics.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import Field, PrivateAttr, model_validator

from nemo_like.config.sections.base import Section
from nemo_like.config.types import Float, Int, OptStr


class TeacherConfig(Section):
    model_name: OptStr = Field(
        None,
        description="The teacher: HF model id or local directory ('embedded:tiny-arith-teacher' is the shipped one); null: no "
        "teacher (no actors start). Its tokenizer must equal the student's.",
    )
    tokenizer_name: OptStr = Field(None, description="The teacher's tokenizer; defaults to teacher.model_name.")
    precision: Literal["float32", "bfloat16"] | None = Field(None, description="The teacher's precision; null: policy.precision.")
    by_task: dict[str, OptStr] = Field(
        default_factory=dict,
        description="Several teachers: task name -> teacher model for that task's samples (null: no teacher for it); tasks "
        "not listed take teacher.model_name (null there: no teacher signal). Every teacher shares the student's tokenizer.",
    )

    # The run's tasks (env.<task>), set by the run config once it is built: only teachers some task uses start.
    _run_tasks: tuple[str, ...] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _by_task_names(self) -> TeacherConfig:
        if self.by_task and self.tokenizer_name is not None:
            raise ValueError("teacher.tokenizer_name applies to teacher.model_name only; with teacher.by_task each teacher uses its own")
        return self

    def for_tasks(self, tasks: Iterable[str]) -> None:
        """Tell the section the run's tasks (the run config does, once built): :meth:`models` and :attr:`enabled` then
        count only the teachers some task uses (a ``teacher.model_name`` that every task's ``by_task`` entry overrides,
        or that no task takes, starts no workers)."""
        self._run_tasks = tuple(tasks)

    @property
    def enabled(self) -> bool:
        """Whether any sample has a teacher."""
        return bool(self.models())

    def models(self) -> list[str]:
        """Every distinct teacher model some task uses (all of them while the run's tasks are unknown), in a fixed
        order (teacher.model_name first)."""
        names = [self.model_name, *self.by_task.values()]
        if self._run_tasks is not None:
            used = {self.model_for(task) for task in self._run_tasks}
            names = [name for name in names if name in used]
        return list(dict.fromkeys(n for n in names if n is not None))

    def unused_model_name(self) -> bool:
        """Whether ``teacher.model_name`` is set but no task of the run takes it (each has its own ``by_task`` entry)."""
        return self.model_name is not None and self._run_tasks is not None and self.model_name not in self.models()

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
    reward_to_go: bool = Field(
        False,
        description="false: each sampled token's teacher signal is its own gap (per-token, discount 0, the usual on-policy "
        "distillation surrogate); true: the sum of the gaps from that token to the end of its row, the exact policy "
        "gradient of the sequence-level reverse KL (a token also changes the prefixes of the later ones).",
    )
    kl_weight: Float = Field(
        0.0,
        ge=0,
        description="Weight of the token-level KL loss term to the teacher (0: off, nothing extra runs): kl_weight x the mean over "
        "sampled tokens of KL(teacher || student) (forward) or KL(student || teacher) (reverse), added to the policy loss.",
    )
    kl_direction: Literal["forward", "reverse"] = Field(
        "forward",
        description="forward: KL(teacher || student), mode-covering (GKD); reverse: KL(student || teacher), mode-seeking.",
    )
    kl_support: Literal["full", "teacher_top_k", "student_top_k"] = Field(
        "full",
        description="The KL's support: the full vocabulary (chunked by policy.logprob_chunk_size), or the kl_top_k tokens most "
        "likely under the teacher / the student plus one tail bucket for the rest of the mass (a lower bound of the full KL).",
    )
    kl_top_k: Int | None = Field(None, gt=0, description="k of a top-k kl_support (required there).")

    @model_validator(mode="after")
    def _kl_keys(self) -> DistillationConfig:
        if self.kl_weight > 0 and self.kl_support != "full" and self.kl_top_k is None:  # off: kl_warnings says so
            raise ValueError(f"distillation.kl_support={self.kl_support} needs distillation.kl_top_k (the support's size)")
        return self

    def kl_warnings(self) -> list[str]:
        """KL-term keys set without effect in this combination."""
        if self.kl_weight == 0:
            changed = [
                f"{k}={getattr(self, k)}"
                for k, default in (("kl_direction", "forward"), ("kl_support", "full"))
                if getattr(self, k) != default
            ]
            changed += [f"kl_top_k={self.kl_top_k}"] if self.kl_top_k is not None else []
            return [f"distillation.{c} has no effect with distillation.kl_weight=0 (the KL term is off)" for c in changed]
        if self.kl_support == "full" and self.kl_top_k is not None:
            return [f"distillation.kl_top_k={self.kl_top_k} has no effect with distillation.kl_support=full"]
        return []

    def top_k_vocab_warning(self, vocab_rows: int) -> str | None:
        """The line saying that a top-k ``kl_support`` is the full KL here: ``kl_top_k`` covers the ``vocab_rows`` rows
        the KL term compares (the rows the student's and the teacher's heads share; known once the models' configs
        are read, at set-up). ``k >= vocab_rows - 1`` leaves the tail bucket at most one token: nothing is merged.
        ``None`` when the term is off, its support is full, or k is smaller."""
        if self.kl_weight == 0 or self.kl_support == "full" or self.kl_top_k is None or self.kl_top_k < vocab_rows - 1:
            return None
        return (
            f"distillation.kl_top_k={self.kl_top_k} has no effect with distillation.kl_support={self.kl_support}: the KL "
            f"term compares {vocab_rows} vocabulary rows, so its top-{self.kl_top_k} support (with the tail bucket) is the "
            "whole vocabulary and the term is the full KL; set distillation.kl_support=full (the same value, without the "
            f"top-k step) or a kl_top_k below {vocab_rows - 1}"
        )


def distillation_errors(teacher: TeacherConfig, d: DistillationConfig, tasks: Iterable[str], tensor_parallel_size: int) -> str | None:
    """The first contradiction between the ``teacher`` and ``distillation`` sections, the run's ``tasks`` (its ``env``
    section names) and the policy's ``tensor_parallel_size`` (``None``: none)."""
    untaught = [task for task in tasks if teacher.model_for(task) is None]
    if teacher.by_task and d.task_advantage_weight == 0 and untaught:  # by_task named the teachers: say whose are missing
        return (
            f"distillation.task_advantage_weight=0 leaves the samples of {untaught} with no training signal: no teacher "
            "applies to them (teacher.by_task.<task> is null, or the task is not listed and teacher.model_name is null); "
            "give them one (teacher.by_task.<task> or teacher.model_name) or the task reward a weight"
        )
    if not teacher.enabled and d.kl_weight > 0:
        return f"distillation.kl_weight={d.kl_weight} needs a teacher: set teacher.model_name (or set kl_weight to 0)"
    if not teacher.enabled and d.task_advantage_weight == 0:
        return (
            "distillation.task_advantage_weight=0 leaves no training signal without a teacher: set teacher.model_name "
            "(distil from it) or give the task reward a weight"
        )
    if d.kl_weight > 0 and teacher.by_task:
        return (
            "distillation.kl_weight>0 with teacher.by_task is not supported: the KL term runs one teacher copy inside the "
            "policy workers for every row; use teacher.model_name alone (or kl_weight=0 for per-task teachers)"
        )
    if d.kl_weight > 0 and tensor_parallel_size > 1:
        return (
            f"distillation.kl_weight={d.kl_weight} with policy.dtensor_cfg.tensor_parallel_size={tensor_parallel_size} is not "
            "supported yet: the KL term's teacher copy is not tensor-parallel; set kl_weight to 0 (the teacher's advantage "
            "still runs) or tensor_parallel_size to 1"
        )
    if teacher.enabled and d.advantage_weight == 0 and d.task_advantage_weight == 0 and d.kl_weight == 0:
        return "distillation.advantage_weight=0 and distillation.task_advantage_weight=0: every advantage would be 0"
    return None


def distillation_warnings(teacher: TeacherConfig, d: DistillationConfig) -> list[str]:
    """Options of the two sections that are set but have no effect."""
    lines = d.kl_warnings()
    if teacher.unused_model_name():
        lines.append(
            f"teacher.model_name={teacher.model_name} has no effect: every task's teacher comes from teacher.by_task "
            f"({teacher.by_task}); its workers do not start"
        )
    if d.reward_to_go and teacher.enabled and d.advantage_weight == 0:
        lines.append("distillation.reward_to_go has no effect with distillation.advantage_weight=0 (no teacher advantage)")
    if not teacher.enabled:
        changed = [k for k in ("advantage_weight", "task_advantage_weight") if getattr(d, k) != 1.0]
        changed += ["reward_to_go"] if d.reward_to_go else []
        changed += [f"teacher.{k}" for k in ("tokenizer_name", "precision") if getattr(teacher, k) is not None]
        for key in changed:
            name = key if key.startswith("teacher.") else f"distillation.{key}"
            why = "teacher.model_name=null (no teacher)" if teacher.model_name is None else "no task of the run has a teacher"
            lines.append(f"{name} has no effect with {why}")
    elif d.advantage_weight == 0 and d.kl_weight == 0:
        lines.append(
            "teacher.model_name is set but distillation.advantage_weight=0 and distillation.kl_weight=0: its signal unused "
            "(no teacher runs)"
        )
    return lines
