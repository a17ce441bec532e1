"""What a refit sends to the generation engine: full weights, LoRA adapters, or LoRA merged into the weights.

Decided once per run (:func:`refit_mode`, called by :func:`~nemo_like.plan.run_plan.decide_run_plan` with the backend
the plan decided); the run plan hands the mode to the :class:`~nemo_like.models.policy.policy.Policy`. How the bytes
travel (object store, shared memory, CUDA IPC, NCCL) is :mod:`nemo_like.models.refit.transport`'s choice.
"""

from __future__ import annotations

from typing import Any

from nemo_like.config.errors import ConfigError
from nemo_like.plan.backend import (  # noqa: F401 (VLLM_MAX_LORA_RANKS, vllm_max_lora_rank: the old import path)
    PLAIN_MODEL,
    VLLM_MAX_LORA_RANKS,
    PolicyModel,
    resolve_backend,
    vllm_adapter_blocker,
    vllm_available,
    vllm_max_lora_rank,
)


def refit_mode(cfg: Any, backend: str | None, model: PolicyModel = PLAIN_MODEL) -> tuple[str, str]:
    """``(mode, reason)``: ``"full"`` (no LoRA), ``"adapter"`` (vLLM serves the adapters as a LoRA request) or
    ``"merged"`` (merged weights through the full-weight refit). ``backend``: the generation backend the run
    resolved to (``inline``, ``hf`` or ``vllm``; the caller decides it once); ``None`` only where the mode does not
    depend on it (no LoRA, or ``policy.lora_cfg.refit=merged``). An explicit ``policy.lora_cfg.refit=adapter``
    the engine cannot honour is a :class:`ConfigError`. ``model``: the policy model's facts (:class:`~.backend.PolicyModel`)."""
    lora = cfg.policy.lora_cfg
    if not lora.enabled:
        return "full", "policy.lora_cfg.enabled=false"
    if lora.refit == "merged":
        return "merged", "policy.lora_cfg.refit=merged"
    if backend is None:
        raise ValueError(f"the LoRA refit mode (policy.lora_cfg.refit={lora.refit}) depends on the generation backend: pass it")
    if backend == "vllm":
        blocker = vllm_adapter_blocker(cfg, model)
    elif chose_another_for_adapters(cfg) and (unserved := vllm_adapter_blocker(cfg, model)):  # why auto chose another
        blocker = f"{unserved} (so the auto backend chose {backend}, which serves plain weights)"
    else:
        blocker = "the HF generation backend serves plain weights"
    if blocker is None:
        return "adapter", "vLLM LoRA: the adapters are loaded as a LoRA request, a new adapter id per weight version"
    if lora.refit == "adapter":
        raise ConfigError(f"policy.lora_cfg.refit=adapter is not possible here: {blocker}; use policy.lora_cfg.refit=auto or merged")
    return "merged", f"auto: {blocker}"


def chose_another_for_adapters(cfg: Any) -> bool:
    """Whether ``auto`` weighed vLLM's adapter limits when it chose the engine: a CPU cluster with vLLM importable
    (:func:`~nemo_like.plan.backend.resolve_backend`; on GPUs it takes vLLM whenever it is installed)."""
    return cfg.policy.generation.backend == "auto" and not cfg.cluster.gpus_per_node and vllm_available()


def merged_precision_warning(cfg: Any, mode: str, model: PolicyModel = PLAIN_MODEL) -> str | None:
    """A warning for a merged LoRA refit in bf16: the engine holds ``W + scale * B @ A`` rounded to bf16, which drops
    the part of the adapters' product below bf16's resolution of ``W`` (early in training, most of it), while the
    policy adds the adapters' product in full; generation then samples from another policy than training scores.
    ``model``: the policy model's facts (where the vLLM adapter refit is impossible: :func:`~.backend.vllm_adapter_blocker`)."""
    if mode != "merged" or cfg.policy.precision != "bfloat16":
        return None
    # the adapter refit is advice only where the run could take it (it was advised where the same plan refuses it)
    blocker = vllm_adapter_blocker(cfg, model)
    remedy = (
        f"use policy.precision=float32 (the vLLM adapter refit is not possible here: {blocker})"
        if blocker
        else "use policy.precision=float32, or the vLLM backend's adapter refit (docs/guides/lora.md)"
    )
    return (
        "WARNING: merged LoRA refit with policy.precision=bfloat16: the engine's weights are W + B @ A * alpha / dim "
        "rounded to bf16, which drops adapter updates below bf16's resolution of W (the policy adds them in full), so "
        f"generation samples from an older policy than training scores (train/gen_kl, train/token_mult_prob_error show "
        f"it); {remedy}"
    )


def refit_mode_of_config(cfg: Any) -> tuple[str, str]:
    """:func:`refit_mode` for a caller that has only the config (tests and tools that build a policy outside a run;
    a run takes the mode from its plan): the backend is resolved here, and only when the mode depends on it."""
    lora = cfg.policy.lora_cfg
    needs_backend = lora.enabled and lora.refit != "merged"
    return refit_mode(cfg, resolve_backend(cfg)[0] if needs_backend else None)
