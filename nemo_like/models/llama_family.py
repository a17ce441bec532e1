"""The Llama-family transformer's pieces, written on a ``*ForCausalLM``'s own parameters.

Shared by the lean sampler's fused step (:mod:`.generation.lean_decoder`) and the shared-prompt training
forward (:mod:`.shared_prefix`): which models they serve exactly (:func:`supported`), RMSNorm as the model
computes it, rotary tables from the model's own rotary module (so every RoPE scaling variant is the model's), and
attention in the dtype that is fast and exact on the device (:func:`attention`).
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


def attention_dtype(device: torch.device, residual: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype attention runs in for a residual stream in ``residual`` and products in ``compute``: float32 on a CPU
    when the residual stream is float32 (autocast over float32 weights: there torch's bfloat16 attention is the slower
    one, forward and backward at the vs-TRL W2 training shapes 74 ms against float32's 24 ms, a decode step 0.8
    against 0.5 ms, and it rounds the scores: ``python benchmarks/cpu_attention.py``), else ``compute`` (a GPU's
    autocast runs its fast bfloat16 kernels; a bfloat16 model attends as its own forward does)."""
    return torch.float32 if device.type == "cpu" and residual == torch.float32 else compute


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, gqa: bool) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of rotated queries ``q`` (in the residual stream's dtype), keys and values,
    in :func:`attention_dtype`: on a CPU with float32 queries, in float32 outside autocast (which would cast it to
    bfloat16); otherwise as called."""
    if q.device.type != "cpu" or q.dtype != torch.float32:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    with torch.autocast("cpu", enabled=False):
        return F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=mask, enable_gqa=gqa)
