"""Attention under CPU autocast: in float32, in every forward of a run.

``policy.precision: bfloat16`` runs forwards and backwards under ``torch.autocast`` over float32 master weights
(:mod:`.precision`). Autocast casts attention to bf16, which on a CPU is the slower kernel (forward and backward at the
vs-TRL W2 training shapes 2.4-3x float32's, a decode step 1.2x: ``python benchmarks/cpu_attention.py``) and one that
rounds the scores. So on a CPU, where the queries are float32 (the residual stream of float32 weights), attention runs
in float32 with autocast off, in all of a run's forwards alike, so that they compute the same numbers:

* the written-out ones (the shared-prompt training forward, the lean sampler's fused step) call :func:`attention`;
* a model's own forward (the fallback of either, the reference and teacher passes) attends through
  :func:`float32_cpu_sdpa`, which :func:`attend_in_float32_on_cpu` installs in place of transformers' ``sdpa``.

A GPU keeps autocast's bf16 kernels (its fast ones); a model loaded in bf16 (an engine under bf16) attends in bf16, as
its own forward does; float32 runs compute exactly what they computed before.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

#: The name :func:`float32_cpu_sdpa` is registered under in transformers' attention (and mask) interfaces.
IMPLEMENTATION = "nemo_like_sdpa"


def _in_float32(queries: torch.Tensor) -> bool:
    """Whether attention over ``queries`` runs in float32 outside autocast: float32 queries on a CPU."""
    return queries.device.type == "cpu" and queries.dtype == torch.float32


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, gqa: bool) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of rotated queries ``q`` (in the residual stream's dtype), keys and values:
    on a CPU with float32 queries in float32 outside autocast (bf16 keys and values cast up); otherwise as called."""
    if not _in_float32(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    with torch.autocast("cpu", enabled=False):
        return F.scaled_dot_product_attention(q, k.float(), v.float(), attn_mask=mask, enable_gqa=gqa)


def float32_cpu_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs):
    """transformers' ``sdpa`` attention function, run as :func:`attention` runs: on a CPU with float32 queries in
    float32 outside autocast (an additive mask cast to float32 with them), otherwise unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _in_float32(query):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.float()
    with torch.autocast("cpu", enabled=False):
        return sdpa_attention_forward(module, query, key.float(), value.float(), attention_mask, **kwargs)


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, float32_cpu_sdpa)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # the masks sdpa's are (an unknown name gets none)


def attend_in_float32_on_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """Let ``model``'s own forward attend through :func:`float32_cpu_sdpa` where it attends through transformers'
    ``sdpa`` (a model on another implementation, or one that cannot switch, is left as it is); returns ``model``."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not model._can_set_attn_implementation():
        return model
    _register()
    model.set_attn_implementation(IMPLEMENTATION)
    return model
