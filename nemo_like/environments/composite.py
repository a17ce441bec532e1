"""Reward composition (``class: composite``): a task's reward is the weighted sum of several reward sources, each an
environment of its own (a built-in name or ``'module:Class'``) with its own settings::

    env:
      math:
        class: composite
        sources:
          correct: {class: math, weight: 1.0}
          rm: {class: reward_model, weight: 0.5, normalize: {squash: tanh}}
          length: {class: length_penalty, weight: 1.0, free_length: 32, penalty_per_unit: 0.01}

``reward = sum_s weight_s * reward_s``. The sources live in the composite's actors (so a reward model source loads
its model there, a judge source starts its engine from there). Each source counts ``<source>/reward_sum`` (its own,
unweighted rewards) and ``<source>/num_samples``, and its own counters as ``<source>/<counter>``; the run sums the
counters over actors and batches and logs ``env/<task>/<source>/reward`` = ``reward_sum / num_samples``, the mean per
sample whatever the number of actors (:func:`nemo_like.experience.rollouts.env_metrics_with_means`).

Accuracy and pass@k count a sample as correct when its *composed* reward is at least 1
(:data:`~nemo_like.environments.interface.CORRECT_REWARD`): keep the other sources' contributions below the
verifier's margin, a penalty (a length penalty, a negative weight) included, or read the verifier's own
``<source>/reward``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nemo_like.environments.agent import AgentEnvironment
from nemo_like.environments.interface import RESERVED_COUNTERS, ActorNeeds, EnvironmentInterface, as_number, check_finite_rewards

#: Keys of a source besides its environment's own settings.
SOURCE_KEYS = ("class", "weight")


def split_source(name: str, section: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
    """``(class, weight, the source environment's settings)`` of one source section."""
    if not isinstance(section, dict):
        raise ValueError(f"sources.{name}: a source is a section {{class: ..., weight: ..., <its settings>}}, got {section!r}")
    settings = {k: v for k, v in section.items() if k not in SOURCE_KEYS}
    path = section.get("class", name)
    weight = section.get("weight", 1.0)
    if not isinstance(path, str):
        raise ValueError(f"sources.{name}.class must be an environment name or 'module:Class', got {path!r}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ValueError(f"sources.{name}.weight must be a finite number, got {weight!r}")
    return path, float(weight), settings


def resolve_source(name: str, section: dict[str, Any]) -> tuple[type[EnvironmentInterface], float, dict[str, Any]]:
    """Import and check one source: its class, weight and checked constructor settings (``ValueError`` naming it)."""
    from nemo_like.environments.registry import check_constructor_kwargs, import_environment_class

    path, weight, settings = split_source(name, section)
    cls = import_environment_class(path, f"sources.{name}.class")
    if issubclass(cls, CompositeEnvironment):
        raise ValueError(f"sources.{name}: a composite cannot be a source of another composite; list its sources here")
    return cls, weight, check_constructor_kwargs(cls, settings, f"sources.{name}", SOURCE_KEYS)


class CompositeEnvConfig(BaseModel):
    """Keys of a composite section."""

    model_config = ConfigDict(extra="forbid")

    sources: dict[str, dict[str, Any]] = Field(..., description="Reward sources by name: {class, weight, <the source's settings>}.")

    @field_validator("sources")
    @classmethod
    def _check_sources(cls, sources: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        if not sources:
            raise ValueError("list at least one reward source: sources: {<name>: {class: ..., weight: ...}}")
        checked = {}
        for name, section in sources.items():
            if not name or "/" in name:
                raise ValueError(f"source name {name!r} must be non-empty and contain no '/' (it names metrics)")
            source_cls, weight, settings = resolve_source(name, section)
            if issubclass(source_cls, AgentEnvironment):
                raise ValueError(
                    f"sources.{name}: an agent task is rolled out by its agent, but a composite scores the policy's own "
                    "responses, so the agent would never run; use class: agent as the task's own environment"
                )
            if source_cls.step is not EnvironmentInterface.step:
                raise ValueError(
                    f"sources.{name}: {source_cls.__name__} is a multi-turn environment (it overrides step); a composite "
                    "scores single-turn responses only, so its turns would never run. Use it as the task's own environment"
                )
            checked[name] = {**settings, "class": section.get("class", name), "weight": weight}
        if all(source["weight"] == 0 for source in checked.values()):
            raise ValueError(
                f"every source of sources has weight 0: the reward is 0 for every sample (no training signal, the models "
                f"still scoring); give one of {sorted(checked)} a weight"
            )
        return checked


def source_devices(sources: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The device of each source that loads a model in the composite's own process (``takes_device``): see
    :func:`place_sources`."""
    return source_placement(sources)[0]


def source_placement(sources: dict[str, dict[str, Any]]) -> tuple[dict[str, str], float]:
    """:func:`place_sources` of a composite's ``sources`` sections: each source's device and the actor's GPUs."""
    return place_sources({name: resolve_source(name, section) for name, section in sources.items()})


def place_sources(resolved: dict[str, tuple[type[EnvironmentInterface], float, dict[str, Any]]]) -> tuple[dict[str, str], float]:
    """:func:`source_devices` of sources already resolved (:func:`resolve_source`), and the GPUs the actor must reserve
    for them (:meth:`CompositeEnvironment.actor_needs`). The actor's GPUs are visible as ``cuda:0``, ``cuda:1``, ...;
    the sources (each of at most one GPU) are packed first-fit in order: a whole-GPU source takes the next untouched
    GPU, one of a fraction shares the first GPU with room for it; ``num_gpus: 0`` is the CPU. The reservation is the
    fractions' sum while they share one GPU, else every GPU touched (0.6 + 0.6 needs two GPUs: their sum, 1.2, left the
    second source a GPU the actor did not have, and Ray refuses a fraction above 1)."""
    devices: dict[str, str] = {}
    free: list[float] = []  # room left on each GPU handed out so far
    for name, (source_cls, _, settings) in resolved.items():
        if not getattr(source_cls, "takes_device", False):
            continue
        gpus = source_cls.actor_needs(settings).num_gpus
        if not gpus:
            devices[name] = "cpu"
            continue
        index = len(free) if gpus >= 1 else next((i for i, room in enumerate(free) if room >= gpus - 1e-9), len(free))
        if index == len(free):
            free.append(1.0)
        free[index] -= gpus
        devices[name] = f"cuda:{index}"
    reserved = float(len(free)) if len(free) > 1 else round(1.0 - free[0], 6) if free else 0.0
    return devices, reserved


@contextmanager
def named_source(name: str, env: Any) -> Iterator[None]:
    """Add a note naming reward source ``name`` to what its call raises: two sources of one class (two reward models)
    are told apart only by their names."""
    try:
        yield
    except Exception as exc:
        exc.add_note(f"raised by reward source '{name}' ({type(env).__name__}) of the composite")
        raise


class CompositeEnvironment(EnvironmentInterface):
    """See the module docstring."""

    config_model: ClassVar[type[BaseModel]] = CompositeEnvConfig

    @classmethod
    def config_warnings(cls, task: str, settings: dict[str, Any], max_rollout_turns: int) -> list[str]:
        """A source of weight 0 (printed once at start-up; every source at 0 is an error of the section)."""
        return [
            f"env.{task}.sources.{name}.weight=0: the source is computed and logged but does not change the reward (a NaN "
            "or infinite one still stops the run)"
            for name, section in settings["sources"].items()
            if split_source(name, section)[1] == 0
        ]

    @classmethod
    def answer_problem(cls, settings: dict[str, Any], answer: Any) -> str | None:
        """The first source's problem with the answer (every source scores it), naming the source. Called per prompt:
        the sources were checked with the section (:func:`resolve_source`), so only their classes are looked up."""
        from nemo_like.environments.registry import import_environment_class

        for name, section in settings["sources"].items():
            path, _, kwargs = split_source(name, section)
            if (problem := import_environment_class(path, f"sources.{name}.class").answer_problem(kwargs, answer)) is not None:
                return f"{problem}, for reward source '{name}'"
        return None

    @classmethod
    def actor_needs(cls, settings: dict[str, Any]) -> ActorNeeds:
        """The sources' needs added up (CPU at least the default's), their helper actors together."""
        resolved = {n: resolve_source(n, s) for n, s in settings["sources"].items()}
        needs = {name: source_cls.actor_needs(kw) for name, (source_cls, _, kw) in resolved.items()}
        placed = place_sources(resolved)
        elsewhere = sum(n.num_gpus for name, n in needs.items() if not getattr(resolved[name][0], "takes_device", False))
        return ActorNeeds(
            num_cpus=round(max(ActorNeeds().num_cpus, sum(n.num_cpus for n in needs.values())), 6),
            num_gpus=placed[1] + elsewhere,
            helpers=tuple(h for n in needs.values() for h in n.helpers),
        )

    def __init__(self, sources: dict[str, dict[str, Any]]) -> None:
        self.sources: dict[str, tuple[EnvironmentInterface, float]] = {}
        resolved = {name: resolve_source(name, section) for name, section in sources.items()}  # each imported once
        devices = place_sources(resolved)[0]
        for name, (source_cls, weight, settings) in resolved.items():
            device = {"device": devices[name]} if name in devices else {}
            self.sources[name] = (source_cls(**settings, **device), weight)
        self._counts: dict[str, float] = {}

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        total = [0.0] * len(responses)
        for name, (env, weight) in self.sources.items():
            with named_source(name, env):
                raw = env.score(responses, metadata)
            rewards = [as_number(r, f"reward source '{name}'", "reward") for r in raw]
            if len(rewards) != len(responses):
                raise ValueError(f"reward source '{name}' returned {len(rewards)} rewards for {len(responses)} responses")
            check_finite_rewards(f"reward source '{name}'", rewards, responses, metadata)
            for i, reward in enumerate(rewards):
                total[i] += weight * reward
            self._add(f"{name}/reward_sum", sum(rewards))
            self._add(f"{name}/num_samples", float(len(rewards)))
            with named_source(name, env):
                counters = env.metrics()
            if clash := sorted(RESERVED_COUNTERS & set(counters)):  # they would add to the composite's own '<name>/...'
                raise ValueError(
                    f"reward source '{name}': metrics() names {clash}, which the composite keeps as '{name}/reward_sum' and "
                    f"'{name}/num_samples' (its env/<task>/{name}/reward); rename them (e.g. 'scored')"
                )
            for key, value in counters.items():
                self._add(f"{name}/{key}", as_number(value, f"reward source '{name}' metrics()", repr(key)))
        return total

    def _add(self, key: str, value: float) -> None:
        self._counts[key] = self._counts.get(key, 0.0) + value

    def metrics(self) -> dict[str, float]:
        counts, self._counts = self._counts, {}
        return counts

    def close(self) -> None:
        """Close every source that has helper processes or actors."""
        for env, _ in self.sources.values():
            close = getattr(env, "close", None)
            if callable(close):
                close()
