"""What a run will ask the cluster for, checked before any actor starts.

A placement group that asks for more than the cluster has stays pending forever; instead of waiting
for ``cluster.placement_timeout_s`` per group, :func:`ensure_cluster_capacity` compares the whole
run's request with the cluster's total resources right after Ray is up and fails with one message
that names every role's request and the shortfall.

The check is against the cluster's *total* resources: it catches requests that can never be
granted (a GPU recipe on a CPU cluster, too many GPUs). Resources that exist but are busy are left
to the per-group placement timeout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from nemo_like.distributed import ray_env  # noqa: F401  (first: sets the env defaults before ray is imported)
from nemo_like.algorithms.logprob_plan import LogprobPlan
from nemo_like.config.schema import MasterConfig
from nemo_like.distributed.worker_group import PlacementError, RoleResources
from nemo_like.environments.arithmetic import environment_resources
from nemo_like.experience.async_rollouts import async_actor_resources
from nemo_like.models.generation import generation_resources
from nemo_like.models.policy.policy import policy_resources

_EPS = 1e-6


def role_requests(cfg: MasterConfig, plan: LogprobPlan) -> list[RoleResources]:
    """Every role ``setup_grpo`` will start, as each role states it; ``plan`` (decided once, in setup) says
    whether the reference model is loaded."""
    roles = [policy_resources(cfg, trainable=True)]
    if plan.load_reference_model:
        roles.append(policy_resources(cfg, trainable=False))
    roles.append(generation_resources(cfg))
    roles.append(environment_resources(cfg))
    if cfg.grpo.async_grpo.enabled:
        roles.extend(async_actor_resources(cfg))
    return roles


def declared_resources(cfg: MasterConfig) -> dict[str, float]:
    """What the recipe says the cluster has: ``cluster.num_nodes`` x ``cluster.gpus_per_node`` GPUs."""
    gpus = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    return {"GPU": float(gpus)} if gpus else {}


def required_resources(cfg: MasterConfig, plan: LogprobPlan) -> dict[str, float]:
    """The run's total request per resource: the roles' sum, at least what the recipe declares."""
    total = _sum(r.total() for r in role_requests(cfg, plan))
    for key, value in declared_resources(cfg).items():
        total[key] = max(total.get(key, 0.0), value)
    return total


def shortfall(required: Mapping[str, float], available_total: Mapping[str, float]) -> dict[str, float]:
    """Per resource, how much more than the cluster has is asked for (empty when everything fits)."""
    short = {}
    for key, asked in required.items():
        missing = asked - available_total.get(key, 0.0)
        if missing > _EPS:
            short[key] = round(missing, 4)
    return short


def check_cluster_capacity(
    required: Mapping[str, float],
    available_total: Mapping[str, float],
    roles: Sequence[RoleResources] = (),
    declared: Mapping[str, float] | None = None,
    hint: str = "",
) -> None:
    """Raise :class:`PlacementError` naming the request (per role and in total) and the cluster's
    resources when ``required`` exceeds ``available_total`` for any resource."""
    short = shortfall(required, available_total)
    if not short:
        return
    lines = [f"The cluster cannot run this recipe: short by {_fmt(short)}."]
    if roles:
        lines.append("Asked for, per role: " + "; ".join(r.describe() for r in roles) + ".")
    if declared:
        lines.append(f"The recipe declares cluster.num_nodes x cluster.gpus_per_node = {_fmt(declared)}.")
    lines.append(f"Asked for in total: {_fmt(required)}.")
    lines.append(f"The cluster has in total: {_fmt({k: available_total.get(k, 0.0) for k in required})}.")
    if hint:
        lines.append(hint)
    lines.append("Lower the request (cluster.gpus_per_node, policy.dp_size, policy.num_cpus_per_worker, env.num_workers) or add nodes.")
    raise PlacementError(" ".join(lines))


def ensure_cluster_capacity(cfg: MasterConfig, plan: LogprobPlan, private_cluster: bool = False) -> None:
    """Check the run's request against the connected Ray cluster's total resources (call after ``init_ray``).

    ``private_cluster``: this run started its own local cluster, which has exactly this machine's GPUs."""
    import ray

    hint = ""
    if private_cluster:
        gpus = ray.cluster_resources().get("GPU", 0.0)
        hint = (
            f"This run started a private local Ray cluster with this machine's resources ({gpus:g} GPUs found): set "
            "cluster.gpus_per_node=0 to run on CPU, or join a cluster that has the GPUs (cluster.ray_address)."
        )
    roles = role_requests(cfg, plan)
    check_cluster_capacity(required_resources(cfg, plan), ray.cluster_resources(), roles, declared_resources(cfg), hint)


def _sum(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return {k: round(v, 6) for k, v in total.items()}


def _fmt(resources: Mapping[str, float]) -> str:
    """``{'CPU': 1.5, 'GPU': 8.0}`` -> ``'CPU 1.5, GPU 8'``."""
    return ", ".join(f"{k} {v:g}" for k, v in resources.items()) or "nothing"
