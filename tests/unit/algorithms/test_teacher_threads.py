"""Every teacher model's workers run the teacher threads of the run plan's split, whatever their group is called
(real teacher actors on the session's Ray cluster)."""

from __future__ import annotations

import ray
import torch

from nemo_like.config import DEFAULT_RECIPE, load_config
from nemo_like.plan.run_plan import decide_run_plan


def test_every_by_task_teacher_group_gets_the_teacher_threads(ray_cluster) -> None:
    """The second and later teachers (groups teacher1, teacher2, ...) got the reference's thread count: the role was
    guessed from the group's name, and only the name 'teacher' was a teacher."""
    from nemo_like.algorithms.distillation import Teachers
    from nemo_like.algorithms.roles import role_requests

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
    plan = decide_run_plan(cfg, (), 8)  # the split of an 8-CPU node: teacher and reference threads differ
    assert plan.threads.teacher != plan.threads.reference  # else the test could not tell them apart
    teachers = Teachers(cfg, plan)
    try:
        running = {
            policy.group.name: ray.get(policy.group.workers[0].__ray_call__.remote(lambda worker: torch.get_num_threads()))
            for policy in teachers.models.values()
        }
    finally:
        teachers.shutdown()
    assert running == {"teacher": plan.threads.teacher, "teacher1": plan.threads.teacher}
    planned = [r.resources.num_threads for r in role_requests(cfg, plan) if r.role == "teacher"]
    assert planned == [plan.threads.teacher] * 2  # what the capacity check and the plan counted
