"""The Ray actors that host environments, and the driver-side handle to all of a run's environments."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from nemo_like.config.errors import ConfigError
from nemo_like.distributed.ray_env import NODE_PYTHONPATH
from nemo_like.distributed.supervision import Replaceable
from nemo_like.distributed.worker_group import Reinitializable, RoleResources, WorkerResources
from nemo_like.environments.interface import (
    DEFAULT_ENV_CPUS,
    HELPER_PLACEMENT,
    RESERVED_COUNTERS,
    RESERVED_STEP_METRICS,
    ActorNeeds,
    EnvironmentStep,
    as_number,
    check_finite_rewards,
    preview,
)
from nemo_like.environments.registry import EnvSpec, import_environment_class, resolve_environments

#: CPU reserved per environment actor by default (they mostly wait; the math verifier's process runs beside it).
ENV_WORKER_CPUS = DEFAULT_ENV_CPUS


def actor_needs(spec: EnvSpec) -> ActorNeeds:
    """What each actor of ``spec`` reserves and starts, as its class states it (:meth:`EnvironmentInterface.actor_needs`)."""
    cls = import_environment_class(spec.class_path, f"env.{spec.task}")
    try:
        return cls.actor_needs(dict(spec.kwargs))
    except ConfigError as exc:  # an agent's verifier settings, checked without its task's name
        raise ConfigError(str(exc).replace("env.<task>", f"env.{spec.task}")) from None


def environment_resources(cfg: Any) -> list[RoleResources]:
    """Per configured task (``env.<task>``): its ``num_workers`` actors as its class sizes them (a small CPU
    reservation by default), and the helper actors each of them starts (a judge's engine: ``judge:<task>``)."""
    roles = []
    for task, spec in resolve_environments(cfg.env_sections).items():
        needs = actor_needs(spec)
        roles.append(RoleResources(f"environment:{task}", spec.num_workers, WorkerResources(needs.num_cpus, needs.num_gpus)))
        for helper in needs.helpers:
            resources = WorkerResources(num_cpus=helper.num_cpus, num_gpus=helper.num_gpus)
            roles.append(RoleResources(f"{helper.role}:{task}", spec.num_workers * helper.count, resources))
    return roles


def checked_counters(task: str, counters: dict[str, Any]) -> dict[str, float]:
    """An environment's :meth:`~.interface.EnvironmentInterface.metrics` as floats; a name the run reserves is an
    error naming it (it overwrote ``env/<task>/reward`` or ``num_samples`` with a value of other samples, silently)."""
    clash = sorted(RESERVED_COUNTERS & set(counters))
    if clash:
        raise ValueError(
            f"environment '{task}': metrics() names {clash}, which the run keeps for env/{task}/reward and "
            f"env/{task}/num_samples; rename them (e.g. 'scored')"
        )
    return {k: as_number(v, f"environment '{task}' metrics()", repr(k)) for k, v in counters.items()}


class EnvironmentWorker(Reinitializable):
    """One environment instance in a Ray actor. Checks every reward batch, and returns the environment's
    counters (:meth:`EnvironmentInterface.metrics`) with it so they belong to exactly that batch.
    Kept between runs by ``reuse_actors`` (closed first by :meth:`Environments.shutdown`, rebuilt by ``reinit``)."""

    def __init__(
        self, rank: int, world_size: int, task: str, class_path: str, kwargs: dict[str, Any], placement_timeout_s: float = 60.0
    ) -> None:
        self.task, self.rank = task, rank
        HELPER_PLACEMENT["timeout_s"] = placement_timeout_s  # the run's cluster.placement_timeout_s, for its helper actors
        cls = import_environment_class(class_path, f"env.{task}")
        self.env = cls(**kwargs)

    def __repr__(self) -> str:  # Ray's error header names the actor by it
        return f"EnvironmentWorker(task={self.task!r}, rank={self.rank})"

    def _call(self, method: str, first_metadata: Any, call: Callable[[], Any]) -> list[Any]:
        """The environment's ``method`` result as a list; its exception re-raised as it is (the driver handles some by
        type: a nested actor's death, a placement error) with a note naming the task and the batch (a bare
        ``KeyError: 'answer'`` named neither, nor which of two tasks sharing a class raised it)."""
        try:
            return list(call())
        except Exception as exc:
            exc.add_note(f"raised by environment '{self.task}' {method}; this actor's batch starts with metadata {preview(first_metadata)}")
            raise

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> tuple[list[float], dict[str, float]]:
        raw = self._call("score", metadata[0] if metadata else None, lambda: self.env.score(responses, metadata))
        rewards = [as_number(value, f"environment '{self.task}'", "reward") for value in raw]
        if len(rewards) != len(responses):
            raise ValueError(f"environment '{self.task}' returned {len(rewards)} rewards for {len(responses)} responses")
        check_finite_rewards(f"environment '{self.task}'", rewards, responses, metadata)
        return rewards, checked_counters(self.task, self.env.metrics())

    def step(
        self, message_logs: list[list[dict[str, str]]], metadata: list[dict[str, Any]]
    ) -> tuple[list[EnvironmentStep], dict[str, float]]:
        """One environment turn for each conversation (multi-turn rollouts), checked, with the env's counters."""
        steps = self._call("step", metadata[0] if metadata else None, lambda: self.env.step(message_logs, metadata))
        if len(steps) != len(message_logs):
            raise ValueError(f"environment '{self.task}' step returned {len(steps)} steps for {len(message_logs)} conversations")
        for i, step in enumerate(steps):  # i is this actor's share's position: the metadata and last message say which
            last = message_logs[i][-1] if message_logs[i] else None
            check_step(
                step,
                f"environment '{self.task}' step, conversation {i} of this actor's {len(steps)} "
                f"(metadata {preview(metadata[i])}, last message {preview(last)})",
            )
        steps = [as_python_numbers(step) for step in steps]
        return steps, checked_counters(self.task, self.env.metrics())

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


def is_finite_number(value: Any) -> bool:
    """A finite real that ``float()`` takes: Python, numpy or one-element torch numbers (``score`` took them all;
    ``step`` refused a numpy float32 reward as "not a finite number")."""
    if isinstance(value, (str, bytes)):
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several elements
        return False


def as_python_numbers(step: EnvironmentStep) -> EnvironmentStep:
    """``step`` with its reward and metric values as Python floats (checked by :func:`check_step`)."""
    metrics = None if step.metrics is None else {k: float(v) for k, v in step.metrics.items()}
    return replace(step, reward=float(step.reward), metrics=metrics)


def check_step(step: Any, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``step`` is a well-formed :class:`EnvironmentStep`."""
    if not isinstance(step, EnvironmentStep):
        raise ValueError(f"{where}: expected an EnvironmentStep, got {type(step).__name__}")
    if not is_finite_number(step.reward):
        raise ValueError(f"{where}: reward must be a finite number, got {step.reward!r}")
    obs = step.observation
    if obs is not None and not (isinstance(obs, dict) and isinstance(obs.get("role"), str) and isinstance(obs.get("content"), str)):
        raise ValueError(f"{where}: observation must be None or {{'role': str, 'content': str}}, got {obs!r}")
    if step.metadata is not None and not isinstance(step.metadata, dict):
        raise ValueError(f"{where}: metadata must be None or a dict, got {type(step.metadata).__name__}")
    stops = step.stop_strings
    if stops is not None and not (isinstance(stops, list) and all(isinstance(x, str) and x for x in stops)):
        raise ValueError(f"{where}: stop_strings must be None or a list of non-empty strings, got {stops!r}")
    numbers = step.metrics
    if numbers is not None and not (
        isinstance(numbers, dict) and all(isinstance(k, str) and is_finite_number(v) for k, v in numbers.items())
    ):
        raise ValueError(f"{where}: metrics must be None or a dict of name -> finite number, got {numbers!r}")
    if numbers and (taken := sorted(RESERVED_STEP_METRICS.intersection(numbers))):
        raise ValueError(
            f"{where}: metrics name {taken[0]!r}, which the turn loop logs itself (multi_turn/{taken[0]}_per_sample); "
            f"rename it (reserved: {sorted(RESERVED_STEP_METRICS)})"
        )


@dataclass
class EnvironmentHandles:
    """Actor handles of every environment, by task; picklable, so actors (the trajectory collector) can
    score with it too. Built by :class:`Environments`; scoring is
    :func:`nemo_like.experience.rollouts.score_with_environment`."""

    workers: dict[str, list[Any]]
    # Driver side only (not pickled): each task's group, whose dead actors the driver replaces in place
    # (:mod:`nemo_like.distributed.supervision`); ``None`` inside another actor, where a death is an error.
    replaceable: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def tasks(self) -> list[str]:
        return list(self.workers)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "replaceable": None}


def actor_python_path(root: str | None) -> dict[str, str]:
    """A user environment imported in the driver from ``root`` must import in its actors too: put ``root``
    first on their ``PYTHONPATH`` (on a multi-node cluster the path must exist on every node)."""
    if root is None:
        return {}
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join([root, *(p for p in current if p != root), NODE_PYTHONPATH])}  # the node's last


class Environments:
    """The run's environment actors: one :class:`~nemo_like.distributed.worker_group.RayWorkerGroup` per
    configured task (``env.<task>``), each with its own actors and settings."""

    def __init__(self, specs: dict[str, EnvSpec], placement_timeout_s: float = 60.0) -> None:
        from nemo_like.distributed.worker_group import RayWorkerGroup, WorkerResources, release_idle_actors

        if any(actor_needs(spec).helpers for spec in specs.values()):
            release_idle_actors()  # their helper groups are placed from inside the environment actors
        self.groups = {}
        try:
            for task, spec in specs.items():
                needs = actor_needs(spec)
                self.groups[task] = RayWorkerGroup(
                    f"environment:{task}",
                    EnvironmentWorker,
                    spec.num_workers,
                    WorkerResources(num_cpus=needs.num_cpus, num_gpus=needs.num_gpus),
                    {"task": task, "class_path": spec.class_path, "kwargs": spec.kwargs, "placement_timeout_s": placement_timeout_s},
                    placement_timeout_s,
                    env_vars=actor_python_path(spec.import_root),
                )
        except BaseException:
            self.shutdown()
            raise
        # The groups' own lists: a replaced actor (distributed/supervision.py) is seen through the handles too.
        self.handles = EnvironmentHandles({task: group.workers for task, group in self.groups.items()})
        self.handles.replaceable = {task: Replaceable("environment", group) for task, group in self.groups.items()}

    def wait_ready(self) -> None:
        """Wait until every environment actor is built (a model-loading verifier takes a while), so the first step's
        calls, and their ``cluster.fault_tolerance.call_timeout_s``, do not count its start-up."""
        for group in self.groups.values():
            group.wait_started()

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
