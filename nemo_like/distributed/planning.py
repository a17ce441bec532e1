"""The run plan on this cluster: :func:`~nemo_like.plan.run_plan.decide_run_plan` with the node CPUs read here."""

from __future__ import annotations

from typing import Any

from nemo_like.distributed.threads import cpu_node_count, declared_node_cpus, node_cpus
from nemo_like.plan.backend import PLAIN_MODEL, PolicyModel
from nemo_like.plan.run_plan import RunPlan, decide_run_plan


def plan_on_cluster(
    cfg: Any,
    eos_token_ids: tuple[int, ...] = (),
    with_policy: bool = True,
    planning_only: bool = False,
    model: PolicyModel = PLAIN_MODEL,
) -> RunPlan:
    """The run plan of ``cfg`` on the running Ray cluster (before Ray starts: on the private cluster ``cfg.cluster``
    describes). Setup calls it once per run; callers that build one component outside a run (tests, benchmarks,
    tools) call it for the decisions that component needs. ``eos_token_ids``: the tokenizer's (only the multi-turn
    settings read them); ``planning_only``: for ``nemo-like plan``, which reaches no cluster (nodes of the declared
    CPUs: :func:`~nemo_like.distributed.threads.declared_node_cpus`, ``cluster.num_nodes`` of them).

    A run on CPU nodes splits threads over the nodes its actors can land on, the cluster's own (Ray places them on
    any): a laptop recipe's ``num_nodes: 1`` on two nodes had given each rank half its node's cores, and a cluster
    recipe on a laptop's private cluster two ranks all of one machine's cores each. GPU clusters keep the declared
    count (a CPU-only head node is no place for a GPU worker; the capacity check compares the GPUs). ``model``: the
    policy model's facts (:func:`~nemo_like.models.loading.policy_model`)."""
    if planning_only:
        cpus, nodes = declared_node_cpus(cfg.cluster), cfg.cluster.num_nodes
    else:
        cpus = node_cpus(cfg.cluster)
        nodes = cfg.cluster.num_nodes if cfg.cluster.gpus_per_node else cpu_node_count()
    return decide_run_plan(cfg, tuple(eos_token_ids), cpus, with_policy, nodes, model)
