"""Check every plug-in name a loaded config holds, before any actor starts.

The config schema keeps plug-in choices as plain strings (it imports nothing of algorithms); this is
the one place they are resolved against their registries (:class:`nemo_like.utils.registry.Registry`):
the advantage estimator, the loss plug-ins (surrogate, KL estimator, importance-weight truncation,
trust region) and the environments (with their tools and reward functions). Called from above: the
CLI (also for ``--dry-run``), :func:`nemo_like.train.train`, :func:`nemo_like.algorithms.setup.setup_grpo`
and :func:`nemo_like.evaluation.run.evaluate`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nemo_like.algorithms.advantages import ADVANTAGE_ESTIMATORS
from nemo_like.algorithms.kl import KL_ESTIMATORS
from nemo_like.algorithms.loss_functions import SURROGATES, TRUNCATIONS, TRUST_REGIONS
from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import MasterConfig
from nemo_like.environments.agent import load_agent_settings
from nemo_like.environments.registry import EnvSpec, resolve_environments
from nemo_like.utils.registry import PluginNameError, Registry

#: The plug-in name keys of a config: (registry, how to read the name; ``None`` means not set).
PLUGIN_KEYS: tuple[tuple[Registry[Any], Callable[[MasterConfig], str | None]], ...] = (
    (ADVANTAGE_ESTIMATORS, lambda cfg: cfg.grpo.adv_estimator.name),
    (SURROGATES, lambda cfg: cfg.loss_fn.surrogate),
    (KL_ESTIMATORS, lambda cfg: cfg.loss_fn.reference_policy_kl_type),
    (TRUNCATIONS, lambda cfg: cfg.loss_fn.truncated_importance_sampling_type),
    (TRUST_REGIONS, lambda cfg: cfg.loss_fn.trust_region_type),
)


def check_algorithm_names(cfg: MasterConfig) -> None:
    """Resolve the advantage estimator and loss plug-in names (importing user code).

    Raises:
        ConfigError: one line per name that does not resolve, each naming its key (with a did-you-mean).
    """
    problems = []
    for registry, read in PLUGIN_KEYS:
        name = read(cfg)
        if name is None:
            continue
        try:
            registry.check(name)
        except PluginNameError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("Invalid configuration:\n  " + "\n  ".join(problems))


def check_plugin_names(cfg: MasterConfig) -> dict[str, EnvSpec]:
    """Check every plug-in name of ``cfg`` (algorithms first, then the environments, their tools and reward
    functions, and the agent tasks' agents); returns the resolved environment specs.

    Raises:
        ConfigError: a name that does not resolve, naming its config key.
    """
    check_algorithm_names(cfg)
    specs = resolve_environments(cfg.env_sections)
    for task in cfg.agent_task_names():  # a user's agent imports here too: --dry-run passed a path that did not resolve
        load_agent_settings(task, specs[task].kwargs)
    return specs
