"""The generation backends by name, and the one factory that builds the run's engine.

Above ``generation/`` and ``policy/``: the ``inline`` backend samples in the policy's own worker
(:mod:`nemo_like.models.policy.inline`), ``hf`` and ``vllm`` are engine actors (:mod:`nemo_like.models.generation`).
A backend is one :func:`register_backend` call: how to build it, what it reserves, the config section only it
reads. Which one a run uses is decided once (:func:`~nemo_like.models.generation.choice.resolve_backend`, the
``auto`` choice and its reason); callers that decided it pass the decision to :func:`generation_resources` and
:func:`build_generation` instead of resolving again.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nemo_like.models.generation.choice import resolve_backend

if TYPE_CHECKING:
    from nemo_like.distributed.worker_group import RoleResources

log = logging.getLogger("nemo_like.models.generation")  # the logger the [setup] backend line has always used

Choice = tuple[str, str]  # (backend, reason), as resolve_backend returns it


@dataclass(frozen=True)
class Backend:
    """One generation backend. ``build(cfg, pad_token_id, eos_token_ids, policy)``: its
    :class:`~nemo_like.models.generation.interface.GenerationInterface`; ``resources(cfg)``: what it reserves.
    ``described``: how start-up warnings name it when chosen. ``config_key``: the ``policy.generation`` section only
    this backend reads (its keys set away from their defaults warn under any other backend, naming ``engine``).
    ``engine_threads``: whether it reads ``policy.generation.num_threads_per_worker``."""

    name: str
    build: Callable[..., Any]
    resources: Callable[[Any], RoleResources]
    described: str
    config_key: str | None = None
    engine: str | None = None
    engine_threads: bool = True


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Add a backend under its name (``policy.generation.backend`` must allow the name)."""
    if backend.name in BACKENDS:
        raise ValueError(f"generation backend {backend.name!r} is registered twice")
    BACKENDS[backend.name] = backend
    return backend


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
    for other in BACKENDS.values():
        if other.name == backend or other.config_key is None:
            continue
        section = getattr(g, other.config_key)
        defaults = type(section)()
        for key in sorted(type(section).model_fields):
            if getattr(section, key) != getattr(defaults, key):
                lines.append(
                    f"policy.generation.{other.config_key}.{key} has no effect with {chosen.described} (no {other.engine} engine starts)"
                )
    return lines


def generation_resources(cfg, with_policy: bool = True, choice: Choice | None = None) -> RoleResources:
    """What the run's generation engine reserves (one worker, as :func:`build_generation` builds it; none for inline
    generation). ``choice``: the backend the caller decided (``None``: resolve it here)."""
    backend, _ = choice or resolve_backend(cfg, with_policy)
    return BACKENDS[backend].resources(cfg)


def build_generation(cfg, pad_token_id: int, eos_token_ids: list[int], policy: Any = None, choice: Choice | None = None):
    """The generation engine ``policy.generation.backend`` asks for. ``policy``: the run's trainable policy (inline
    generation samples in its worker; with vLLM it enables the GPU refit paths); ``None`` for evaluation.
    ``choice``: the backend the caller decided (``None``: resolve it here)."""
    backend, reason = choice or resolve_backend(cfg, with_policy=policy is not None)
    message = f"[setup] generation backend: {backend} ({reason})"
    log.info(message)
    print(message, file=sys.stderr)
    for line in ignored_engine_keys(cfg, backend):
        warnings.warn(line, RuntimeWarning, stacklevel=2)
    return BACKENDS[backend].build(cfg, pad_token_id, eos_token_ids, policy)


# -- the backends (imported when used: the driver loads only the chosen one) --------------------------------------


def _build_inline(cfg, pad_token_id: int, eos_token_ids: list[int], policy: Any):
    from nemo_like.models.policy.inline import InlineGeneration

    return InlineGeneration(policy, pad_token_id, eos_token_ids)


def _inline_resources(cfg) -> RoleResources:
    from nemo_like.models.policy.inline import inline_generation_resources

    return inline_generation_resources()


def _build_hf(cfg, pad_token_id: int, eos_token_ids: list[int], policy: Any):
    from nemo_like.models.generation.hf import HFGeneration

    return HFGeneration(cfg, pad_token_id, eos_token_ids)


def _hf_resources(cfg) -> RoleResources:
    from nemo_like.models.generation.hf import hf_generation_resources

    return hf_generation_resources(cfg)


def _build_vllm(cfg, pad_token_id: int, eos_token_ids: list[int], policy: Any):
    from nemo_like.models.generation.vllm import VLLMGeneration

    return VLLMGeneration(cfg, pad_token_id, eos_token_ids, policy=policy)


def _vllm_resources(cfg) -> RoleResources:
    from nemo_like.models.generation.vllm import vllm_generation_resources

    return vllm_generation_resources(cfg)


register_backend(Backend("inline", _build_inline, _inline_resources, described="inline generation", engine_threads=False))
register_backend(Backend("hf", _build_hf, _hf_resources, described="the hf engine"))
register_backend(Backend("vllm", _build_vllm, _vllm_resources, described="the vLLM engine", config_key="vllm_cfg", engine="vLLM"))
