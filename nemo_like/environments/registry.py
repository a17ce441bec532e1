"""Which environment scores which sample: built-ins by name, user classes by ``module:Class``, and the
task-name routing (``metadata["task_name"]`` -> the ``env.<task>`` section).

Config shape (``env`` in a recipe; one section per task, the section name is the task name)::

    env:
      arithmetic: {num_workers: 1}                         # built-in, by section name
      math: {num_workers: 2, timeout_s: 5.0, format_reward: 0.0}
      gsm8k: {class: math, num_workers: 1}                 # a built-in under another task name
      my_task: {class: "my_pkg.envs:MyEnv", num_workers: 1, threshold: 0.5}   # extra keys -> MyEnv(**kwargs)

Everything here runs in the driver, before any actor starts, so a wrong path or key is a
:class:`~nemo_like.config.errors.ConfigError` naming the ``env.<task>`` key.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from nemo_like.config.errors import ConfigError, did_you_mean
from nemo_like.environments.interface import EnvironmentInterface
from nemo_like.utils.imports import FILE_MODULE_PREFIX
from nemo_like.utils.registry import PluginNameError, Registry


def _check_environment_class(cls: object, path: str, where: str) -> None:
    """The validator of :data:`ENVIRONMENTS`: a concrete subclass of :class:`EnvironmentInterface`."""
    if not inspect.isclass(cls):
        raise PluginNameError(where, f"{where}: '{path}' is a {type(cls).__name__}, not a class implementing EnvironmentInterface")
    if not issubclass(cls, EnvironmentInterface):
        missing = "" if callable(getattr(cls, "score", None)) else " (it has no score method)"
        raise PluginNameError(
            where,
            f"{where}: class '{path}' does not subclass nemo_like.environments.interface.EnvironmentInterface{missing}; "
            "implement score(responses, metadata) -> list[float] on a subclass",
        )
    if inspect.isabstract(cls):
        raise PluginNameError(where, f"{where}: class '{path}' leaves abstract methods unimplemented: {sorted(cls.__abstractmethods__)}")


def _unknown_environment(name: str, where: str, names: list[str]) -> str:
    return f"{where} must be a built-in environment ({', '.join(BUILTIN_ENVIRONMENTS)}) or 'module:Class', got {name!r}"


#: Environments: a built-in name (usable as a section name or as ``class:``) or ``'module:Class'``.
ENVIRONMENTS: Registry[type[EnvironmentInterface]] = Registry(
    "environment", "env.<task>.class", validate=_check_environment_class, unknown=_unknown_environment, user_code="'module:Class'"
)
ENVIRONMENTS.add_path("arithmetic", "nemo_like.environments.arithmetic:ArithmeticEnvironment")
ENVIRONMENTS.add_path("math", "nemo_like.environments.math:MathEnvironment")
ENVIRONMENTS.add_path("tool", "nemo_like.environments.tools.environment:ToolEnvironment")
ENVIRONMENTS.add_path("guess_number", "nemo_like.environments.games.guess_number:GuessNumberEnvironment")
ENVIRONMENTS.add_path("reward_model", "nemo_like.environments.reward_model:RewardModelEnvironment")
ENVIRONMENTS.add_path("judge", "nemo_like.environments.judge:JudgeEnvironment")
ENVIRONMENTS.add_path("composite", "nemo_like.environments.composite:CompositeEnvironment")
ENVIRONMENTS.add_path("length_penalty", "nemo_like.environments.length_penalty:LengthPenaltyEnvironment")
ENVIRONMENTS.add_path("agent", "nemo_like.environments.agent:AgentEnvironment")
#: Built-in environments: name -> import path (the import path is what :class:`EnvSpec` carries to the actors).
BUILTIN_ENVIRONMENTS: dict[str, str] = {name: ENVIRONMENTS.path_of(name) or "" for name in ENVIRONMENTS}
#: The metadata key naming a sample's task (the ``env`` section that scores it).
TASK_KEY = "task_name"


@dataclass(frozen=True)
class EnvSpec:
    """One configured environment: the task it serves, its class (import path), actors and kwargs."""

    task: str
    class_path: str
    num_workers: int = 1
    kwargs: dict[str, Any] = field(default_factory=dict)
    import_root: str | None = None  # sys.path entry the driver imported a user class from (given to its actors)


def import_root(module_name: str) -> str | None:
    """The ``sys.path`` entry ``module_name`` was imported from (``/x`` for ``/x/pkg/mod.py`` as ``pkg.mod``),
    or ``None`` for built-ins and modules without a file."""
    import sys
    from pathlib import Path

    file = getattr(sys.modules.get(module_name), "__file__", None)
    if not file:
        return None
    path = Path(file).resolve()
    depth = module_name.count(".") + (2 if path.name == "__init__.py" else 1)
    return str(path.parents[depth - 1])


def import_environment_class(path: str, where: str) -> type[EnvironmentInterface]:
    """Import ``'package.module:Class'`` (or a built-in name) and check it implements :class:`EnvironmentInterface`.

    ``where`` names the config key in errors (e.g. ``env.my_task.class``)."""
    module_name, sep, attr = path.partition(":")
    if sep and (not module_name or not attr):
        raise PluginNameError(where, _unknown_environment(path, where, ENVIRONMENTS.names()))
    return ENVIRONMENTS.get(path, where)


#: The first line of a section's refusal (then one problem per line).
INVALID_SECTION = "Invalid environment configuration:\n  "


def check_constructor_kwargs(cls: type, kwargs: Mapping[str, Any], where: str, section_keys: Sequence[str] = ()) -> dict[str, Any]:
    """Validate an environment's section keys against ``cls.config_model`` (when declared) and its
    constructor signature; returns the keyword arguments to construct it with. ``section_keys``: the section's own
    keys besides the environment's (``class``, ``num_workers``), offered with them for a misspelled key."""
    kwargs = dict(kwargs)

    def hint(key: str, names: Iterable[str]) -> str:
        return did_you_mean(f"{where}.{key}", [f"{where}.{name}" for name in [*names, *section_keys]])

    model = getattr(cls, "config_model", None)
    if model is not None:
        try:
            kwargs = model.model_validate(kwargs).model_dump()
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                key = ".".join(str(p) for p in err["loc"])
                name = f"{where}.{key}" if key else where  # a check of the whole section has no key of its own
                if err["type"] == "extra_forbidden":
                    problems.append(f"{name}: unknown key.{hint(key, model.model_fields)}")
                elif err["type"] == "value_error":  # a nested section's (a composite's source): its problems, no header
                    problems.append(f"{name}: {err['msg'].removeprefix('Value error, ').removeprefix(INVALID_SECTION)}")
                else:
                    problems.append(f"{name}: {err['msg']} (got {err.get('input')!r})")
            raise ConfigError(INVALID_SECTION + "\n  ".join(problems)) from None
    params = inspect.signature(cls).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        accepted = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for key in kwargs:
            if key not in accepted:
                raise ConfigError(
                    f"{where}.{key}: unknown key; {cls.__name__}.__init__ accepts {accepted or 'no arguments'}.{hint(key, accepted)}"
                )
    required = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in kwargs
    ]
    if required:
        raise ConfigError(f"{where}: {cls.__name__}.__init__ requires {required}; add them to the section")
    return kwargs


def actor_importable_path(path: str, cls: type, where: str) -> str:
    """The path the environment actors (other processes) import ``cls`` by: ``path`` itself (a built-in's, or a
    ``'module:Class'``), or for a class registered in the driver's own process (``ENVIRONMENTS.add``) its defining
    module's. A :class:`ConfigError` naming ``where`` for a class no other process can import (one defined in the
    script being run, ``__main__``, or inside a function): the actors failed on it after the run had started."""
    if path in BUILTIN_ENVIRONMENTS or path in BUILTIN_ENVIRONMENTS.values():
        return path
    module, qualname = (path.partition(":")[0], path.partition(":")[2]) if ":" in path else (cls.__module__, cls.__qualname__)
    if module.startswith(FILE_MODULE_PREFIX):  # a class of a file imported by path: the actors import that file
        module = getattr(sys.modules.get(module), "__file__", None) or module
    if module == "__main__" or "<locals>" in qualname:
        raise ConfigError(
            f"{where}: {cls.__qualname__} is defined in {'the script being run (__main__)' if module == '__main__' else 'a function'}, "
            "which the environment actors (other processes) cannot import: put the class in a module and name it "
            "'file.py:Class' or 'package.module:Class'"
        )
    return f"{module}:{qualname}"


def with_importable_inner_classes(path: str, kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """``kwargs`` with the classes a composite's sources and an agent's verifier name (resolved again in the actors)
    as :func:`actor_importable_path` gives them."""

    def importable(name: str, key: str) -> str:
        return actor_importable_path(name, import_environment_class(name, key), key)

    if path == BUILTIN_ENVIRONMENTS["composite"] and isinstance(kwargs.get("sources"), Mapping):
        sources = {}
        for name, source in kwargs["sources"].items():
            if isinstance(source, Mapping) and isinstance(source.get("class", name), str):
                source = {**source, "class": importable(source.get("class", name), f"{where}.sources.{name}.class")}
            sources[name] = source
        return {**kwargs, "sources": sources}
    if path == BUILTIN_ENVIRONMENTS["agent"] and isinstance(kwargs.get("verifier"), str):
        return {**kwargs, "verifier": importable(kwargs["verifier"], f"{where}.verifier")}
    return kwargs


def resolve_environments(env_cfg: Mapping[str, Any]) -> dict[str, EnvSpec]:
    """Turn the validated ``env`` sections (:class:`~nemo_like.config.schema.EnvSectionConfig`) into
    :class:`EnvSpec` s, importing and checking every class in the driver."""
    if not env_cfg:
        raise ConfigError("env: no environment configured; add a section such as env.arithmetic: {num_workers: 1}")
    specs = {}
    for task, section in env_cfg.items():
        name = section.env_class or task
        where = f"env.{task}.class" if section.env_class else f"env.{task}"
        if name in BUILTIN_ENVIRONMENTS:
            path = BUILTIN_ENVIRONMENTS[name]
        elif ":" in name or section.env_class:
            path = name
        else:
            raise ConfigError(
                f"env.{task}: '{task}' is not a built-in environment ({', '.join(BUILTIN_ENVIRONMENTS)}); "
                f"set env.{task}.class to a built-in name or 'module:Class'.{did_you_mean(task, BUILTIN_ENVIRONMENTS)}"
            )
        cls = import_environment_class(path, where)
        path = actor_importable_path(path, cls, where)
        kwargs = check_constructor_kwargs(cls, section.model_extra or {}, f"env.{task}", ("class", "num_workers"))
        kwargs = with_importable_inner_classes(path, kwargs, f"env.{task}")
        root = None if path in BUILTIN_ENVIRONMENTS.values() else import_root(path.partition(":")[0])
        specs[task] = EnvSpec(task, path, section.num_workers, kwargs, root)
    return specs


def task_of(metadata: Mapping[str, Any], tasks: Collection[str]) -> str:
    """The task (environment section) of one sample: ``metadata["task_name"]``; a sample without one goes
    to the only configured environment, and is an error when several are configured."""
    task = metadata.get(TASK_KEY)
    if task is None:
        if len(tasks) == 1:
            return next(iter(tasks))
        raise ConfigError(
            f"a sample has no metadata['{TASK_KEY}'] and several environments are configured ({', '.join(sorted(tasks))}); "
            "the data must name each sample's task"
        )
    if task not in tasks:
        raise ConfigError(
            f"samples of task '{task}' have no environment: configured environments are {', '.join(sorted(tasks))}; "
            f"add an env.{task} section (a built-in: {', '.join(BUILTIN_ENVIRONMENTS)}, or class: 'module:Class')"
        )
    return task


def route_by_task(metadata: Sequence[Mapping[str, Any]], tasks: Collection[str]) -> dict[str, list[int]]:
    """Indices of the samples of each task, in order (raises :class:`ConfigError` for an unknown task)."""
    routes: dict[str, list[int]] = {}
    for index, meta in enumerate(metadata):
        routes.setdefault(task_of(meta, tasks), []).append(index)
    return routes


def check_tasks_have_environments(metadata: Iterable[Mapping[str, Any]], tasks: Collection[str], where: str) -> dict[str, int]:
    """Fail before any actor starts when a prompt's task has no environment; returns prompts per task."""
    counts: dict[str, int] = {}
    for meta in metadata:
        try:
            task = task_of(meta, tasks)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        counts[task] = counts.get(task, 0) + 1
    return counts
