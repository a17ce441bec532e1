"""A group of identical Ray actors placed by resources, with broadcast and sharded dispatch.

The training loop talks to a :class:`RayWorkerGroup` as if it were one object; the group turns a
call into one remote call per actor and gathers the results.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nemo_like.distributed.ray_env import worker_env_vars


class WorkerFailure(RuntimeError):
    """A Ray actor died or raised while the driver waited on it; the message names actor and phase."""


class PlacementError(RuntimeError):
    """The cluster cannot grant the resources an actor group asked for."""


@dataclass(frozen=True)
class WorkerResources:
    """What each actor of a group reserves: CPU bundles on CPU machines, GPU bundles on GPU ones."""

    num_cpus: float
    num_gpus: float = 0.0
    num_threads: int | None = None

    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.num_cpus}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        return bundle


def reserve_bundles(name: str, resources: WorkerResources, count: int, timeout_s: float, strategy: str = "PACK") -> PlacementGroup:
    """Create a placement group of ``count`` bundles (Ray placement ``strategy``) and wait for it; fail clearly instead of hanging."""
    pg = placement_group([resources.bundle()] * count, strategy=strategy, name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        asked = {k: v * count for k, v in resources.bundle().items()}
        raise PlacementError(
            f"Cannot place '{name}': asked for {count} x {resources.bundle()} = {asked} ({strategy}) within {timeout_s:.0f}s; "
            f"cluster has {ray.cluster_resources()} in total, {ray.available_resources()} available now"
        )
    return pg


class RayWorkerGroup:
    """``num_workers`` actors of ``actor_cls``; each gets ``rank`` and ``world_size`` keyword args."""

    def __init__(
        self,
        name: str,
        actor_cls: type,
        num_workers: int,
        resources: WorkerResources,
        init_kwargs: dict[str, Any],
        placement_timeout_s: float = 60.0,
        env_vars: dict[str, str] | None = None,
        max_concurrency: int = 1,
        strategy: str = "PACK",
    ) -> None:
        """``env_vars`` are added to (and override) each actor's :func:`worker_env_vars`; ``max_concurrency > 1``
        makes threaded actors (methods may run while another call is busy); ``strategy`` is the Ray placement
        strategy of the group's bundles (``cluster.placement_strategy``)."""
        self.name = name
        self._pg = reserve_bundles(name, resources, num_workers, placement_timeout_s, strategy)
        remote_cls = ray.remote(actor_cls)
        self.workers = []
        for rank in range(num_workers):
            options = dict(
                num_cpus=resources.num_cpus,
                num_gpus=resources.num_gpus,
                name=None,
                runtime_env={"env_vars": {**worker_env_vars(resources.num_threads), **(env_vars or {})}},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
                max_concurrency=max_concurrency,
            )
            self.workers.append(remote_cls.options(**options).remote(rank=rank, world_size=num_workers, **init_kwargs))

    def __len__(self) -> int:
        return len(self.workers)

    def run_all(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call ``method`` with the same arguments on every worker; returns the object refs."""
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def run_sharded(self, method: str, shards: Sequence[Any], **kwargs: Any) -> list[ray.ObjectRef]:
        """Call ``method`` on worker i with ``shards[i]`` as the first argument."""
        if len(shards) != len(self.workers):
            raise ValueError(f"{self.name}: got {len(shards)} shards for {len(self.workers)} workers")
        return [getattr(w, method).remote(shard, **kwargs) for w, shard in zip(self.workers, shards)]

    def run_rank0(self, method: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Call ``method`` on the first worker only."""
        return getattr(self.workers[0], method).remote(*args, **kwargs)

    def shutdown(self) -> None:
        """Kill the actors and release their bundles."""
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        remove_placement_group(self._pg)


def get_with_context(refs: Any, what: str, timeout_s: float | None = None) -> Any:
    """``ray.get`` that names the phase and the failing actor when an actor dies, so the error is actionable."""
    start = time.monotonic()
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.RayActorError as exc:
        actor = getattr(exc, "actor_id", None)
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise WorkerFailure(
            f"Ray actor {actor or '(unknown id)'} died during '{what}' after {time.monotonic() - start:.1f}s: {detail}"
        ) from exc
