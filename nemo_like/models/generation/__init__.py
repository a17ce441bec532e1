"""Generation backends (inline in the policy worker, HF transformers, vLLM) behind one interface, and the
factory that picks one."""

from __future__ import annotations

import logging
import sys
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nemo_like.distributed.worker_group import RoleResources

log = logging.getLogger(__name__)


def resolve_backend(cfg: Any, with_policy: bool = True) -> tuple[str, str]:
    """``(backend, reason)`` for ``policy.generation.backend``. ``auto`` on a CPU cluster: ``inline`` when the run
    allows it (:func:`~.inline.inline_blocker`), else ``vllm`` for a LoRA run when the package is importable (it
    serves the adapters: a refit sends only them), else ``hf`` (an engine actor with our sampling loop: it generated
    the tiny recipe's batches 1.5-2.7x faster than vLLM's CPU build, ``benchmarks/async_vs_sync.py``); on a GPU
    cluster ``vllm`` when the package is importable, else ``hf``. ``with_policy=False``: the caller has no trainable
    policy (evaluation), so ``inline`` is impossible."""
    from nemo_like.config.errors import ConfigError
    from nemo_like.models.generation.inline import inline_blocker
    from nemo_like.models.generation.vllm import require_vllm, vllm_available

    requested = cfg.policy.generation.backend
    if requested == "inline":
        blocker = inline_blocker(cfg, with_policy)
        if blocker is not None:
            raise ConfigError(f"policy.generation.backend=inline is not possible here: {blocker}; use auto, vllm or hf")
        return "inline", "requested"
    if requested == "auto":
        if cfg.cluster.gpus_per_node:
            if vllm_available():
                return "vllm", "auto: a GPU cluster with vllm importable"
            return "hf", "auto: a GPU cluster, but vllm is not installed"
        blocker = inline_blocker(cfg, with_policy)
        if blocker is None:
            return "inline", "auto: a sync CPU run with one policy worker samples with the policy's own weights (no refit)"
        if cfg.policy.lora_cfg.enabled and with_policy and vllm_available():
            return "vllm", f"auto: not inline ({blocker}); vLLM serves the LoRA adapters, so a refit sends only them"
        return "hf", f"auto: not inline ({blocker}); a CPU cluster's engine (policy.generation.backend=vllm: vLLM's CPU build)"
    if requested == "vllm":
        require_vllm()
    return requested, "requested"


def ignored_engine_keys(cfg: Any, backend: str) -> list[str]:
    """One line per engine option set in ``cfg`` that ``backend`` ignores: the vLLM options for ``inline`` and ``hf``,
    and the engine's thread count for ``inline`` (start-up warnings, not errors: flipping
    ``policy.generation.backend`` on the command line must not need other edits)."""
    if backend == "vllm":
        return []
    g = cfg.policy.generation
    lines = []
    what = "inline generation" if backend == "inline" else "the hf engine"
    if backend == "inline" and g.num_threads_per_worker not in ("auto", None):
        lines.append(
            f"policy.generation.num_threads_per_worker={g.num_threads_per_worker} has no effect with inline generation "
            "(the policy worker samples with its own policy.num_threads_per_worker threads)"
        )
    defaults = type(g.vllm_cfg)()
    for key in sorted(type(g.vllm_cfg).model_fields):
        if getattr(g.vllm_cfg, key) != getattr(defaults, key):
            lines.append(f"policy.generation.vllm_cfg.{key} has no effect with {what} (no vLLM engine starts)")
    return lines


def generation_resources(cfg, with_policy: bool = True) -> RoleResources:
    """What the generation engine ``policy.generation.backend`` resolves to reserves (one worker, as built below;
    none for inline generation)."""
    backend, _ = resolve_backend(cfg, with_policy)
    if backend == "inline":
        from nemo_like.models.generation.inline import inline_generation_resources

        return inline_generation_resources()
    if backend == "vllm":
        from nemo_like.models.generation.vllm import vllm_generation_resources

        return vllm_generation_resources(cfg)
    from nemo_like.models.generation.hf import hf_generation_resources

    return hf_generation_resources(cfg)


def make_generation(cfg, pad_token_id: int, eos_token_ids: list[int], policy: Any = None):
    """The generation engine ``policy.generation.backend`` asks for. ``policy``: the run's trainable policy (inline
    generation samples in its worker; with vLLM it enables the GPU refit paths); ``None`` for evaluation."""
    backend, reason = resolve_backend(cfg, with_policy=policy is not None)
    message = f"[setup] generation backend: {backend} ({reason})"
    log.info(message)
    print(message, file=sys.stderr)
    for line in ignored_engine_keys(cfg, backend):
        warnings.warn(line, RuntimeWarning, stacklevel=2)
    if backend == "inline":
        from nemo_like.models.generation.inline import InlineGeneration

        return InlineGeneration(policy, pad_token_id, eos_token_ids)
    if backend == "vllm":
        from nemo_like.models.generation.vllm import VLLMGeneration

        return VLLMGeneration(cfg, pad_token_id, eos_token_ids, policy=policy)
    from nemo_like.models.generation.hf import HFGeneration

    return HFGeneration(cfg, pad_token_id, eos_token_ids)
