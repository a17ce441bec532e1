"""The generation backends by name, and the one factory that builds the run's engine.

Above ``generation/`` and ``policy/``: the ``inline`` backend samples in the policy's own worker
(:mod:`nemo_like.models.policy.inline`), ``hf`` and ``vllm`` are engine actors (:mod:`nemo_like.models.generation`).
A backend is one :func:`register_backend` call: how to build it, what it reserves, the config section only it
reads. The backends live in the project's one plug-in registry (:class:`~nemo_like.utils.registry.Registry`), so an
unknown name gets the same did-you-mean error as every other plug-in. Which one a run uses is part of the run plan
(:func:`~nemo_like.plan.backend.resolve_backend`, the ``auto`` choice and its reason, decided once in setup);
:func:`generation_resources` and :func:`build_generation` take the plan.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nemo_like.plan.backend import GENERATION_ENGINES
from nemo_like.utils.registry import PluginNameError, Registry

if TYPE_CHECKING:
    from nemo_like.distributed.worker_group import RoleResources
    from nemo_like.plan.run_plan import RunPlan

log = logging.getLogger("nemo_like.models.generation")  # the logger the [setup] backend line has always used


@dataclass(frozen=True)
class Backend:
    """One generation backend. ``build(cfg, pad_token_id, eos_token_ids, policy, plan)``: its
    :class:`~nemo_like.models.generation.interface.GenerationInterface`; ``resources(cfg, plan)``: what it reserves.
    ``described``: how start-up warnings name it when chosen. ``config_keys``: the ``policy.generation`` sections only
    this backend reads (their keys set away from their defaults warn under any other backend, naming ``engine``).
    ``engine_threads``: whether it reads ``policy.generation.num_threads_per_worker``."""

    name: str
    build: Callable[..., Any]
    resources: Callable[[Any, RunPlan], RoleResources]
    described: str
    config_keys: tuple[str, ...] = ()
    engine: str | None = None
    engine_threads: bool = True


def _require_backend(obj: object, name: str, key: str) -> None:
    if not isinstance(obj, Backend):
        raise PluginNameError(key, f"{key}: {name!r} is not a nemo_like.models.engines.Backend")


BACKENDS: Registry[Backend] = Registry("generation backend", "policy.generation.backend", validate=_require_backend)


def register_backend(backend: Backend) -> Backend:
    """Add a backend under its name (``policy.generation.backend`` must allow the name); a name taken twice is a
    ``ValueError``."""
    BACKENDS.add(backend.name, backend)
    return backend


#: Backend-only keys whose non-default value asks for what the other backends do anyway: no warning for them
#: (``colocated.enabled=false``: an HF engine always has a device of its own; async GPU runs must set it).
SAME_EFFECT_ELSEWHERE = frozenset({"colocated.enabled"})


def ignored_engine_keys(cfg: Any, backend: str) -> list[str]:
    """One line per engine option set in ``cfg`` that ``backend`` ignores: the vLLM options for ``inline`` and ``hf``,
    and the engine's thread count for ``inline`` (start-up warnings, not errors: flipping
    ``policy.generation.backend`` on the command line must not need other edits)."""
    chosen = BACKENDS[backend]
    g = cfg.policy.generation
    lines = []
    if not chosen.engine_threads and g.num_threads_per_worker not in ("auto", None):
        lines.append(
            f"policy.generation.num_threads_per_worker={g.num_threads_per_worker} has no effect with {chosen.described} "
            "(the policy worker samples with its own policy.num_threads_per_worker threads)"
        )
    for other in (BACKENDS[name] for name in BACKENDS):
        if other.name == backend:
            continue
        for config_key in other.config_keys:
            section = getattr(g, config_key)
            defaults = type(section)()
            for key in sorted(type(section).model_fields):
                if f"{config_key}.{key}" in SAME_EFFECT_ELSEWHERE:
                    continue
                if getattr(section, key) != getattr(defaults, key):
                    lines.append(
                        f"policy.generation.{config_key}.{key} has no effect with {chosen.described} (no {other.engine} engine starts)"
                    )
    if backend == "vllm":
        lines += vllm_keys_for_the_other_device(cfg)
    return lines


def _as_written(value: Any) -> Any:
    """A config value as a recipe or an override writes it (``false``, not Python's ``False``)."""
    return str(value).lower() if isinstance(value, bool) else value


#: vLLM options that apply on one kind of device only (the engine reads them there alone).
VLLM_GPU_ONLY = ("vllm_cfg.gpu_memory_utilization", "colocated.offload_optimizer")
VLLM_CPU_ONLY = ("vllm_cfg.kv_cache_space_gib",)


def vllm_keys_for_the_other_device(cfg: Any) -> list[str]:
    """One line per vLLM option set in ``cfg`` that only the other kind of cluster reads: the GPU memory share and the
    colocated optimizer offload on a CPU cluster, the CPU KV-cache size on a GPU one."""
    on_gpu = bool(cfg.cluster.gpus_per_node)
    g = cfg.policy.generation
    lines = []
    for dotted in VLLM_CPU_ONLY if on_gpu else VLLM_GPU_ONLY:
        section_name, key = dotted.split(".")
        section = getattr(g, section_name)
        if getattr(section, key) != getattr(type(section)(), key):
            where = "a GPU cluster (it sizes the CPU engine's KV cache)" if on_gpu else "a CPU cluster (GPU only)"
            lines.append(f"policy.generation.{dotted}={_as_written(getattr(section, key))} has no effect with the vLLM engine on {where}")
    colocated = g.colocated
    if on_gpu and colocated.offload_optimizer != type(colocated)().offload_optimizer:
        value = _as_written(colocated.offload_optimizer)
        if not colocated.enabled:
            lines.append(
                f"policy.generation.colocated.offload_optimizer={value} has no effect with "
                "policy.generation.colocated.enabled=false (the engine has GPUs of its own: nothing is offloaded to make room)"
            )
        elif cfg.offloads_to_cpu():
            lines.append(
                f"policy.generation.colocated.offload_optimizer={value} has no effect with policy.dtensor_cfg.cpu_offload=true "
                "(FSDP2 keeps the AdamW state in host RAM already)"
            )
    return lines


def generation_resources(cfg, plan: RunPlan) -> RoleResources:
    """What the run's generation engine reserves (``GENERATION_ENGINES`` workers, as :func:`build_generation` builds
    them; none for inline generation), for the backend and thread split ``plan`` decided."""
    return BACKENDS[plan.backend.value].resources(cfg, plan)


def build_generation(cfg, pad_token_id: int, eos_token_ids: list[int], policy: Any = None, plan: RunPlan | None = None):
    """The generation engine the run plan chose. ``policy``: the run's trainable policy (inline generation samples in
    its worker; with vLLM it enables the GPU refit paths); ``None`` for evaluation. ``plan``: the run's plan (``None``,
    for a caller outside a run: decided here on the running cluster)."""
    if plan is None:
        from nemo_like.distributed.planning import plan_on_cluster

        plan = plan_on_cluster(cfg, tuple(eos_token_ids), with_policy=policy is not None)
    backend = plan.backend.value
    message = f"[setup] generation backend: {backend} ({plan.backend.reason})"
    log.info(message)
    if policy is None:  # a training run's [plan] lines say it (it was printed twice, word for word)
        print(message, file=sys.stderr)
    for line in ignored_engine_keys(cfg, backend):
        warnings.warn(line, RuntimeWarning, stacklevel=2)
    return BACKENDS[backend].build(cfg, pad_token_id, eos_token_ids, policy, plan)


# -- the backends (imported when used: the driver loads only the chosen one) --------------------------------------


def _build_inline(cfg, pad_token_id: int, eos_token_ids: list[int], policy: Any, plan: RunPlan):
    from nemo_like.models.loading import tokenizer_source
    from nemo_like.models.policy.inline import InlineGeneration

    return InlineGeneration(policy, pad_token_id, eos_token_ids, tokenizer_source(cfg.policy))


def _inline_resources(cfg, plan: RunPlan) -> RoleResources:
    from nemo_like.models.policy.inline import inline_generation_resources

    return inline_generation_resources()


def _build_hf(cfg, pad_token_id: int, eos_token_ids: list[int], policy: Any, plan: RunPlan):
    from nemo_like.models.generation.hf import HFGeneration

    return HFGeneration(cfg, pad_token_id, eos_token_ids, plan.threads.generation, GENERATION_ENGINES)


def _hf_resources(cfg, plan: RunPlan) -> RoleResources:
    from nemo_like.models.generation.hf import hf_generation_resources

    return hf_generation_resources(cfg, plan.threads.generation, GENERATION_ENGINES)


def _build_vllm(cfg, pad_token_id: int, eos_token_ids: list[int], policy: Any, plan: RunPlan):
    from nemo_like.models.generation.vllm import VLLMGeneration

    return VLLMGeneration(
        cfg, pad_token_id, eos_token_ids, plan.threads.generation, GENERATION_ENGINES, policy=policy, refit_mode=plan.refit.value
    )


def _vllm_resources(cfg, plan: RunPlan) -> RoleResources:
    from nemo_like.models.generation.vllm import vllm_generation_resources

    return vllm_generation_resources(cfg, plan.threads.generation, GENERATION_ENGINES)


register_backend(Backend("inline", _build_inline, _inline_resources, described="inline generation", engine_threads=False))
register_backend(Backend("hf", _build_hf, _hf_resources, described="the hf engine"))
register_backend(
    Backend("vllm", _build_vllm, _vllm_resources, described="the vLLM engine", config_keys=("vllm_cfg", "colocated"), engine="vLLM")
)
