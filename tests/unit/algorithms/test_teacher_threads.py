"""Every teacher model's workers get the teacher threads of the run plan's split, whatever their group is called."""

from __future__ import annotations

from typing import Any

from nemo_like.config import DEFAULT_RECIPE, load_config
from nemo_like.plan.run_plan import decide_run_plan


class RecordingGroup:
    """Stands in for ``RayWorkerGroup``: records what each group would start, starts nothing."""

    started: list[tuple[str, Any]] = []

    def __init__(self, name: str, actor_cls: type, num_workers: int, resources: Any, *args: Any, **kwargs: Any) -> None:
        self.name, self.workers = name, []
        RecordingGroup.started.append((name, resources))

    def shutdown(self) -> None:
        pass


def test_every_by_task_teacher_group_gets_the_teacher_threads(monkeypatch) -> None:
    """The second and later teachers (groups teacher1, teacher2, ...) got the reference's thread count: the role was
    guessed from the group's name, and only the name 'teacher' was a teacher."""
    from nemo_like.algorithms.distillation import Teachers
    from nemo_like.algorithms.roles import role_requests
    from nemo_like.models.policy import policy as policy_module

    cfg = load_config(
        DEFAULT_RECIPE,
        [
            "teacher.model_name=embedded:tiny-arith-teacher",
            "+teacher.by_task.math=embedded:tiny-arith-qwen2",
            "+env.math.num_workers=1",
            "loss_fn.reference_policy_kl_penalty=0",
        ],
        warn=False,
    )
    plan = decide_run_plan(cfg, (), 8)
    assert plan.threads.teacher != plan.threads.reference  # else the test could not tell them apart
    RecordingGroup.started = []
    monkeypatch.setattr(policy_module, "RayWorkerGroup", RecordingGroup)
    Teachers(cfg, plan, wait=False)
    assert [name for name, _ in RecordingGroup.started] == ["teacher", "teacher1"]
    assert [r.num_threads for _, r in RecordingGroup.started] == [plan.threads.teacher] * 2
    planned = [r.resources.num_threads for r in role_requests(cfg, plan) if r.role == "teacher"]
    assert planned == [plan.threads.teacher] * 2  # what the capacity check and the plan counted
