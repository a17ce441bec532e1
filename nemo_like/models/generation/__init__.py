"""Generation backends (HF transformers, vLLM) behind one interface, and the factory that picks one."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nemo_like.distributed.worker_group import RoleResources

log = logging.getLogger(__name__)


def resolve_backend(requested: str) -> tuple[str, str]:
    """``(backend, reason)``: ``auto`` becomes ``vllm`` when the vllm package is importable, else ``hf``."""
    from nemo_like.models.generation.vllm import require_vllm, vllm_available

    if requested == "auto":
        return ("vllm", "auto: vllm is importable") if vllm_available() else ("hf", "auto: vllm is not installed")
    if requested == "vllm":
        require_vllm()
    return requested, "requested"


def generation_resources(cfg) -> RoleResources:
    """What the generation engine ``policy.generation.backend`` resolves to reserves (one worker, as built below)."""
    backend, _ = resolve_backend(cfg.policy.generation.backend)
    if backend == "vllm":
        from nemo_like.models.generation.vllm import vllm_generation_resources

        return vllm_generation_resources(cfg)
    from nemo_like.models.generation.hf import hf_generation_resources

    return hf_generation_resources(cfg)


def make_generation(cfg, pad_token_id: int, eos_token_ids: list[int], policy: Any = None):
    """The generation engine ``policy.generation.backend`` asks for (``policy`` enables the GPU refit paths)."""
    backend, reason = resolve_backend(cfg.policy.generation.backend)
    message = f"[setup] generation backend: {backend} ({reason})"
    log.info(message)
    print(message, file=sys.stderr)
    if backend == "vllm":
        from nemo_like.models.generation.vllm import VLLMGeneration

        return VLLMGeneration(cfg, pad_token_id, eos_token_ids, policy=policy)
    from nemo_like.models.generation.hf import HFGeneration

    return HFGeneration(cfg, pad_token_id, eos_token_ids)
