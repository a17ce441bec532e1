"""Whether a cluster can grant a run's request, checked before any actor starts.

A placement group that asks for more than the cluster has stays pending forever; instead of waiting
for ``cluster.placement_timeout_s`` per group, the run compares its whole request (the roles that
``nemo_like.algorithms.roles`` lists) with the cluster's total resources right after Ray is up and
fails with one message that names every role's request and the shortfall.

The check is against the cluster's *total* resources (a GPU recipe on a CPU cluster, too many GPUs)
and its nodes (:func:`check_node_placement`: a bundle no node holds, a strict strategy the nodes
cannot meet): requests that can never be granted. Resources that exist but are busy are left to the
per-group placement timeout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from nemo_like.distributed.worker_group import PlacementError, RoleResources

_EPS = 1e-6


def sum_resources(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Add resource dicts key by key."""
    total: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return {k: round(v, 6) for k, v in total.items()}


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
    resources when ``required`` exceeds ``available_total`` for any resource; ``hint`` (what to do about missing GPUs)
    only where GPUs are short."""
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
    if hint and "GPU" in short:  # a CPU-only shortfall asked nothing of GPUs (it said "roles ask for a GPU")
        lines.append(hint)
    lines.append(
        "Lower the request (cluster.gpus_per_node, policy.dp_size, policy.num_cpus_per_worker, env.<task>.num_workers) or add nodes."
    )
    raise PlacementError(" ".join(lines))


def check_node_placement(
    roles: Sequence[RoleResources], nodes: Sequence[Mapping[str, float]], strategies: Mapping[str, str] | None = None
) -> None:
    """Raise :class:`PlacementError` for a role the cluster's nodes can never place, whatever the totals say: a bundle
    no single node holds, more ``STRICT_SPREAD`` bundles than nodes that hold one, or ``STRICT_PACK`` bundles that no
    node holds together. ``nodes``: each alive node's total resources; ``strategies``: the Ray placement strategy of a
    role (by name; ``PACK`` when not given). Such a request had passed the totals check and waited out
    ``cluster.placement_timeout_s``."""
    strategies = strategies or {}
    problems = []
    for role in roles:
        bundle = role.bundle
        holding = [n for n in nodes if _holds(n, bundle)]
        strategy = strategies.get(role.role, "PACK")
        if not holding:
            problems.append(f"{role.role}: one bundle ({_fmt(bundle)}) fits on no node")
        elif strategy == "STRICT_SPREAD" and len(holding) < role.count:
            problems.append(f"{role.role}: {role.count} bundles STRICT_SPREAD need {role.count} nodes that hold one; {len(holding)} do")
        elif strategy == "STRICT_PACK" and not any(_holds(n, role.total()) for n in nodes):
            problems.append(f"{role.role}: {role.count} bundles STRICT_PACK ({_fmt(role.total())}) fit on no single node")
    problems += _gpu_share_problems(roles, nodes)
    problems += _cpu_share_problems(roles, nodes)
    if problems:
        largest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)), default={})
        raise PlacementError(
            "The cluster cannot place this recipe on its nodes: " + "; ".join(problems) + f". It has {len(nodes)} node(s); "
            f"the largest has {_fmt({k: v for k, v in largest.items() if k in ('CPU', 'GPU')})}. Lower the per-actor request "
            "(policy.num_cpus_per_worker, cluster.gpus_per_node), change cluster.placement_strategy, or add nodes."
        )


_GPU_UNITS = 10_000  # Ray counts a resource in units of 1/10000 (its FixedPoint), one GPU instance at a time


def _gpu_share_problems(roles: Sequence[RoleResources], nodes: Sequence[Mapping[str, float]]) -> list[str]:
    """Ray grants a fraction of a GPU out of one GPU, and a whole number of GPUs whole. So no ``k + 1`` shares above
    ``1/(k+1)`` of a GPU fit on one GPU, nor does any share on a GPU a whole-GPU bundle holds: for every ``k``, the
    GPUs needed are at least the whole GPUs asked for plus ``ceil(#shares above 1/(k+1) / k)``. A line for the ``k``
    that needs the most, when that is more than the nodes have; a sound bound (it never refuses what Ray can place:
    each share is counted at its Ray units rounded down). ``k = 1`` is "two shares above one half never share a GPU".

    Three actors of 0.6 GPU on 2 GPUs (``k = 1``), and five of 0.4 on 2 GPUs (``k = 2``: at most two to a GPU, so 3
    GPUs) had passed the totals check (1.8, 2 <= 2) and waited out ``cluster.placement_timeout_s``."""
    gpus = sum(n.get("GPU", 0.0) for n in nodes)
    shares = [(role.role, role.bundle.get("GPU", 0.0)) for role in roles for _ in range(role.count)]
    whole = sum(g for _, g in shares if g >= 1 - _EPS)
    fractions = [(name, g, int(g * _GPU_UNITS + _EPS)) for name, g in shares if _EPS < g < 1 - _EPS]
    worst = _most_needed(fractions, _GPU_UNITS, whole, gpus)
    if worst is None:
        return []
    need, k, over = worst
    asked = ", ".join(sorted({f"{name} {g:g}" for name, g in over}))
    size = "half a GPU" if k == 1 else f"1/{k + 1} of a GPU"
    share = "which no two can share" if k == 1 else f"of which no {k + 1} can share a GPU (at most {k} to a GPU)"
    return [
        f"{len(over)} bundles ask for more than {size} each ({asked}), {share}, besides {whole:g} whole GPUs: "
        f"{need:g} GPUs, and the nodes have {gpus:g}: short by GPU {need - gpus:g}"
    ]


def _cpu_share_problems(roles: Sequence[RoleResources], nodes: Sequence[Mapping[str, float]]) -> list[str]:
    """The same bound for CPU bundles on nodes: no node holds ``k + 1`` bundles above ``1/(k+1)`` of the largest node's
    CPUs. Three bundles of 0.6 CPU (two roles) on two 1-CPU nodes had passed every check (1.8 <= 2 in total, each
    fits a node) and waited out ``cluster.placement_timeout_s``."""
    largest = max((n.get("CPU", 0.0) for n in nodes), default=0.0)
    bundles = [(role.role, role.bundle.get("CPU", 0.0)) for role in roles for _ in range(role.count)]
    sized = [(name, c, int(c * _GPU_UNITS + _EPS)) for name, c in bundles if _EPS < c <= largest + _EPS]
    worst = _most_needed(sized, int(largest * _GPU_UNITS + _EPS), 0, len(nodes))
    if worst is None:
        return []
    need, k, over = worst
    asked = ", ".join(sorted({f"{name} {c:g}" for name, c in over}))
    return [
        f"{len(over)} bundles ask for more than 1/{k + 1} of the largest node's {largest:g} CPUs each ({asked}), at most "
        f"{k} to a node: {need:g} nodes, and the cluster has {len(nodes)}"
    ]


def _most_needed(
    items: list[tuple[str, float, int]], capacity: int, taken: float, have: float
) -> tuple[float, int, list[tuple[str, float]]] | None:
    """Items of ``units`` each (name, size, units) in containers of ``capacity`` units (a GPU, a node): no container
    holds ``k + 1`` items above ``1/(k+1)`` of it, so for every ``k`` those items need ``ceil(count / k)`` containers,
    besides ``taken`` ones. The ``(need, k, items over)`` of the ``k`` that needs the most, when that is more than
    ``have``; None when none is. Sound: it never refuses what fits (each item is counted at its units rounded down)."""
    worst: tuple[float, int, list[tuple[str, float]]] | None = None
    # An item of u units is above 1/(k+1) for every k >= capacity // u; between two such k the count is constant and
    # the bound falls with k, so these k are the only ones to try.
    for k in sorted({capacity // units for _, _, units in items if units and capacity // units >= 1}):
        over = [(name, size) for name, size, units in items if (k + 1) * units > capacity]  # no k + 1 fit in a container
        need = taken + math.ceil(len(over) / k)
        if need > have + _EPS and (worst is None or need > worst[0]):
            worst = (need, k, over)
    return worst


def _holds(node: Mapping[str, float], request: Mapping[str, float]) -> bool:
    return all(node.get(key, 0.0) + _EPS >= value for key, value in request.items() if value > 0)


def private_cluster_hint(gpus: float | None = None, gpus_per_node: int | None = None, gpu_roles: Sequence[str] = ()) -> str:
    """What to do when a private local cluster (this machine's resources) is too small. ``gpus``: this machine's GPU
    count (default: the running cluster's); ``gpus_per_node``: ``cluster.gpus_per_node``, where 0 starts the cluster
    with no GPU whatever the machine has (:func:`~nemo_like.distributed.ray_init.local_init_kwargs`), so the advice to
    set it to 0 would be the setting already; ``gpu_roles``: the roles that ask for a GPU, named in that case."""
    if gpus is None:
        import ray

        gpus = ray.cluster_resources().get("GPU", 0.0)
    if gpus_per_node == 0:
        roles = f" ({', '.join(gpu_roles)})" if gpu_roles else ""
        if gpus:
            why = f"cluster.gpus_per_node=0 hides this machine's {gpus:g} GPUs from it"
            fix = (
                "Set those roles' num_gpus to 0, or cluster.gpus_per_node > 0 to give it them (then the policy and the "
                "generation engine take GPUs of their own too)"
            )
        else:
            why = "cluster.gpus_per_node=0, and this machine has no GPU either (0 GPUs found)"
            fix = "Set those roles' num_gpus to 0"
        return (
            f"This run uses a private local Ray cluster, started with no GPU: {why}, yet roles ask for a GPU{roles}. "
            f"{fix}, or join a cluster that has the GPUs (cluster.ray_address)."
        )
    return (
        f"This run uses a private local Ray cluster with this machine's resources ({gpus:g} GPUs found): set "
        "cluster.gpus_per_node=0 to run on CPU, or join a cluster that has the GPUs (cluster.ray_address)."
    )


def _fmt(resources: Mapping[str, float]) -> str:
    """``{'CPU': 1.5, 'GPU': 8.0}`` -> ``'CPU 1.5, GPU 8'``."""
    return ", ".join(f"{k} {v:g}" for k, v in resources.items()) or "nothing"
