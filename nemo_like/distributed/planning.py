"""The run plan on this cluster: :func:`~nemo_like.plan.run_plan.decide_run_plan` with the node CPUs read here."""

from __future__ import annotations

from typing import Any

from nemo_like.distributed.threads import declared_node_cpus, node_cpus
from nemo_like.plan.run_plan import RunPlan, decide_run_plan


def plan_on_cluster(cfg: Any, eos_token_ids: tuple[int, ...] = (), with_policy: bool = True, planning_only: bool = False) -> RunPlan:
    """The run plan of ``cfg`` on the running Ray cluster (before Ray starts: on the private cluster ``cfg.cluster``
    describes). Setup calls it once per run; callers that build one component outside a run (tests, benchmarks,
    tools) call it for the decisions that component needs. ``eos_token_ids``: the tokenizer's (only the multi-turn
    settings read them); ``planning_only``: for ``nemo-like plan``, which reaches no cluster (nodes of the declared
    CPUs: :func:`~nemo_like.distributed.threads.declared_node_cpus`)."""
    cpus = declared_node_cpus(cfg.cluster) if planning_only else node_cpus(cfg.cluster)
    return decide_run_plan(cfg, tuple(eos_token_ids), cpus, with_policy)
