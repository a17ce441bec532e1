"""The Llama-family transformer's pieces, written on a ``*ForCausalLM``'s own parameters.

Shared by the lean sampler's fused step (:mod:`.generation.lean_decoder`) and the shared-prompt training
forward (:mod:`.shared_prefix`): which models they serve exactly (:func:`supported`), RMSNorm as the model
computes it, and rotary tables from the model's own rotary module (so every RoPE scaling variant is the model's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_like.models.rope import POSITION_DEPENDENT_ROPE, rope_type

MODEL_TYPES = ("llama", "qwen2", "mistral")


def supported(model: torch.nn.Module) -> bool:
    """Whether the written-out transformer computes exactly what ``model`` computes (Llama, Qwen2, Mistral without a
    sliding window; SiLU MLP without bias; full attention in every layer; RoPE whose frequencies do not depend on the
    sequence's length)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in MODEL_TYPES:
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ["full_attention"])):
        return False  # sliding-window layers
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        return False
    if rope_type(cfg) in POSITION_DEPENDENT_ROPE:
        # tables built once for every position a sampling call can reach would not be the ones the model's forward over
        # the actual, shorter sequence uses; past the pretrained context a run is refused (loading.check_trained_length)
        return False
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "layers") and hasattr(inner, "rotary_emb") and hasattr(model, "lm_head")


def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """The model's RMSNorm module applied as it computes it: in float32, the weight applied after casting back."""
    return rms_norm_with(x, norm.weight, norm_eps(norm))


def norm_eps(norm: torch.nn.Module) -> float:
    """An RMSNorm module's epsilon (``variance_epsilon`` in transformers' Llama family, ``eps`` in torch's)."""
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def rms_norm_with(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the Llama family computes it: normalised in float32, cast back to ``x``'s dtype, then scaled by
    ``weight`` (in bf16 a fused ``F.rms_norm(x, ..., weight)`` rounds differently: logits off by 0.1, other tokens)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def rotary_tables(
    rotary_emb: torch.nn.Module, positions: torch.Tensor, dtype: torch.dtype, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed_sin)``, ``[*positions.shape, head_dim]``, from the model's rotary module. ``rotate_half(x) =
    roll(x, half) * sign`` (sign ``-1`` on the first half), so the sign is folded into the sine once: RoPE is then
    ``x * cos + roll(x, half) * signed_sin``."""
    dummy = torch.empty(0, dtype=dtype, device=positions.device)
    cos, sin = rotary_emb(dummy, positions)
    sign = torch.ones(head_dim, dtype=sin.dtype, device=sin.device)
    sign[: head_dim // 2] = -1
    return cos, sin * sign
