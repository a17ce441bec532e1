"""The run plan on this cluster: :func:`~nemo_like.plan.run_plan.decide_run_plan` with the node CPUs read here."""

from __future__ import annotations

from typing import Any

from nemo_like.distributed.threads import node_cpus
from nemo_like.plan.run_plan import RunPlan, decide_run_plan


def plan_on_cluster(cfg: Any, eos_token_ids: tuple[int, ...] = (), with_policy: bool = True) -> RunPlan:
    """The run plan of ``cfg`` on the running Ray cluster (before Ray starts: on the private cluster ``cfg.cluster``
    describes). Setup calls it once per run; callers that build one component outside a run (tests, benchmarks,
    tools) call it for the decisions that component needs. ``eos_token_ids``: the tokenizer's (only the multi-turn
    settings read them)."""
    return decide_run_plan(cfg, tuple(eos_token_ids), node_cpus(cfg.cluster), with_policy)
