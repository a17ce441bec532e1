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
from dataclasses import dataclass

from nemo_like.distributed import ray_env  # noqa: F401  (first: sets the env defaults before ray is imported)
from nemo_like.algorithms.logprob_plan import decide_logprob_passes
from nemo_like.config.schema import MasterConfig
from nemo_like.distributed.worker_group import PlacementError

ENV_WORKER_CPUS = 0.1  # the reward actors' reservation (see nemo_like/algorithms/setup.py)
ASYNC_ACTOR_CPUS = 0.05  # the trajectory collector and the replay buffer (async GRPO): they mostly wait
_EPS = 1e-6


@dataclass(frozen=True)
class RoleRequest:
    """``count`` actors of one role, each reserving ``bundle`` (one placement-group bundle)."""

    role: str
    count: int
    bundle: Mapping[str, float]

    def total(self) -> dict[str, float]:
        return {k: v * self.count for k, v in self.bundle.items()}

    def describe(self) -> str:
        return f"{self.role} {self.count} x {_fmt(self.bundle)}"


def role_requests(cfg: MasterConfig) -> list[RoleRequest]:
    """Per role, what ``setup_grpo`` will reserve: CPU bundles, plus 1 GPU each when the recipe has GPUs."""
    pc = cfg.policy
    model_bundle = {"CPU": pc.num_cpus_per_worker}
    if cfg.cluster.gpus_per_node:
        model_bundle["GPU"] = 1.0
    ranks = pc.dp_size * pc.dtensor_cfg.tensor_parallel_size
    roles = [RoleRequest("policy", ranks, model_bundle)]
    if decide_logprob_passes(cfg).load_reference_model:
        roles.append(RoleRequest("reference", ranks, model_bundle))
    roles.append(RoleRequest("generation", 1, model_bundle))
    roles.append(RoleRequest("environment", cfg.env.num_workers, {"CPU": ENV_WORKER_CPUS}))
    if cfg.grpo.async_grpo.enabled:
        roles.append(RoleRequest("trajectory_collector", 1, {"CPU": ASYNC_ACTOR_CPUS}))
        roles.append(RoleRequest("replay_buffer", 1, {"CPU": ASYNC_ACTOR_CPUS}))
    return roles


def declared_resources(cfg: MasterConfig) -> dict[str, float]:
    """What the recipe says the cluster has: ``cluster.num_nodes`` x ``cluster.gpus_per_node`` GPUs."""
    gpus = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    return {"GPU": float(gpus)} if gpus else {}


def required_resources(cfg: MasterConfig) -> dict[str, float]:
    """The run's total request per resource: the actors' sum, at least what the recipe declares."""
    total = _sum(r.total() for r in role_requests(cfg))
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
    roles: Sequence[RoleRequest] = (),
    declared: Mapping[str, float] | None = None,
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
    lines.append("Lower the request (cluster.gpus_per_node, policy.dp_size, policy.num_cpus_per_worker, env.num_workers) or add nodes.")
    raise PlacementError(" ".join(lines))


def ensure_cluster_capacity(cfg: MasterConfig) -> None:
    """Check the run's request against the connected Ray cluster's total resources (call after ``init_ray``)."""
    import ray

    check_cluster_capacity(required_resources(cfg), ray.cluster_resources(), role_requests(cfg), declared_resources(cfg))


def _sum(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return {k: round(v, 6) for k, v in total.items()}


def _fmt(resources: Mapping[str, float]) -> str:
    """``{'CPU': 1.5, 'GPU': 8.0}`` -> ``'CPU 1.5, GPU 8'``."""
    return ", ".join(f"{k} {v:g}" for k, v in resources.items()) or "nothing"
