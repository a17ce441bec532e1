"""The Ray actors that host environments, and the driver-side handle to all of a run's environments."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from nemo_like.distributed.worker_group import Reinitializable, RoleResources, WorkerResources
from nemo_like.environments.registry import EnvSpec, import_environment_class

#: CPU reserved per environment actor (they mostly wait; the math verifier's process runs beside it).
ENV_WORKER_CPUS = 0.1


def environment_resources(cfg: Any) -> list[RoleResources]:
    """One role per configured task (``env.<task>``): its ``num_workers`` actors, a small CPU reservation each."""
    return [
        RoleResources(f"environment:{task}", section.num_workers, WorkerResources(num_cpus=ENV_WORKER_CPUS))
        for task, section in cfg.env_sections.items()
    ]


class EnvironmentWorker(Reinitializable):
    """One environment instance in a Ray actor. Checks every reward batch, and returns the environment's
    counters (:meth:`EnvironmentInterface.metrics`) with it so they belong to exactly that batch.
    Kept between runs by ``reuse_actors`` (closed first by :meth:`Environments.shutdown`, rebuilt by ``reinit``)."""

    def __init__(self, rank: int, world_size: int, task: str, class_path: str, kwargs: dict[str, Any]) -> None:
        self.task = task
        cls = import_environment_class(class_path, f"env.{task}")
        self.env = cls(**kwargs)

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> tuple[list[float], dict[str, float]]:
        rewards = [float(r) for r in self.env.score(responses, metadata)]
        if len(rewards) != len(responses):
            raise ValueError(f"environment '{self.task}' returned {len(rewards)} rewards for {len(responses)} responses")
        bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
        if bad:
            raise ValueError(f"environment '{self.task}' returned non-finite rewards for responses {bad[:10]}")
        return rewards, {k: float(v) for k, v in self.env.metrics().items()}

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


@dataclass
class EnvironmentHandles:
    """Actor handles of every environment, by task; picklable, so actors (the trajectory collector) can
    score with it too. Built by :class:`Environments`; scoring is
    :func:`nemo_like.experience.rollouts.score_with_environment`."""

    workers: dict[str, list[Any]]

    @property
    def tasks(self) -> list[str]:
        return list(self.workers)


def actor_python_path(root: str | None) -> dict[str, str]:
    """A user environment imported in the driver from ``root`` must import in its actors too: put ``root``
    first on their ``PYTHONPATH`` (on a multi-node cluster the path must exist on every node)."""
    if root is None:
        return {}
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join([root, *(p for p in current if p != root)])}


class Environments:
    """The run's environment actors: one :class:`~nemo_like.distributed.worker_group.RayWorkerGroup` per
    configured task (``env.<task>``), each with its own actors and settings."""

    def __init__(self, specs: dict[str, EnvSpec], placement_timeout_s: float = 60.0) -> None:
        from nemo_like.distributed.worker_group import RayWorkerGroup, WorkerResources

        self.groups = {}
        try:
            for task, spec in specs.items():
                self.groups[task] = RayWorkerGroup(
                    f"environment:{task}",
                    EnvironmentWorker,
                    spec.num_workers,
                    WorkerResources(num_cpus=ENV_WORKER_CPUS),
                    {"task": task, "class_path": spec.class_path, "kwargs": spec.kwargs},
                    placement_timeout_s,
                    env_vars=actor_python_path(spec.import_root),
                )
        except BaseException:
            self.shutdown()
            raise
        self.handles = EnvironmentHandles({task: list(group.workers) for task, group in self.groups.items()})

    def shutdown(self) -> None:
        """Close each environment (its helper processes), then kill the actors."""
        import ray

        for group in self.groups.values():
            try:
                ray.get([w.close.remote() for w in group.workers], timeout=10)
            except Exception:  # noqa: BLE001 - a dead actor cannot close; it is killed next anyway
                pass
            group.shutdown()
        self.groups = {}
