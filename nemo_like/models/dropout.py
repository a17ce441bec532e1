"""The policy trains without the model's own dropout.

Generation samples in eval mode (no dropout), so the distribution the policy gradient is about is the dropout-free
one; and the training forward runs in train mode, where a model whose config sets ``attention_dropout`` (or GPT-2's
``*_pdrop``, OPT's ``layerdrop``, or Mixtral's ``router_jitter_noise``) would drop out or add noise: a skipped prev-logprob pass (one
optimizer step per rollout) would then stand for a forward it does not equal (the loss changed, the ratio-clip
warnings and the divergence metrics measured dropout noise). LoRA's own dropout (``policy.lora_cfg.dropout``) is
PEFT's, added after this.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True)
class ConfigRate:
    """A dropout rate the model's config held (``part``: the config or its text config)."""

    part: Any
    name: str
    value: float

    def __str__(self) -> str:
        return f"{self.name}={self.value:g}"


#: Module attributes that hold a router's train-mode-only input noise (Mixtral's and MiniMax's ``jitter_noise``,
#: PhiMoE's ``input_jitter_noise``, DBRX's ``moe_jitter_eps``). Not PhiMoE's router's ``router_jitter_noise``: its
#: sparsemixer's cut-off, in eval mode too.
NOISE_ATTRIBUTES = ("jitter_noise", "input_jitter_noise", "moe_jitter_eps")


def _is_rate(name: str, value: object, config_type: str | None = None) -> bool:
    """A dropout rate, a LayerDrop rate (OPT's ``layerdrop``: layers skipped at random), or train-mode-only router
    noise: on a module (``config_type`` None) :data:`NOISE_ATTRIBUTES`, on a config those and ``*jitter_noise`` fields
    but PhiMoE's ``router_jitter_noise``."""
    if not isinstance(value, float) or value <= 0:
        return False
    if "dropout" in name or name.endswith("pdrop") or "layerdrop" in name:
        return True
    if config_type is None or name in NOISE_ATTRIBUTES:
        return name in NOISE_ATTRIBUTES
    return name.endswith("jitter_noise") and not (config_type == "phimoe" and name == "router_jitter_noise")


def _config_parts(config: Any) -> list[Any]:
    """``config``, its text config and the configs nested in them (DBRX's ``ffn_config``, ``attn_config``)."""
    parts, queue = {}, [config, *([config.get_text_config()] if hasattr(config, "get_text_config") else [])]
    while queue:
        part = queue.pop()
        if id(part) in parts:
            continue
        parts[id(part)] = part
        queue += [v for v in vars(part).values() if isinstance(v, PretrainedConfig)]
    return list(parts.values())


def disable_dropout(model: torch.nn.Module) -> list[ConfigRate]:
    """Set every dropout rate of ``model`` to 0: its ``nn.Dropout`` modules, the rates modules copied from the config
    when they were built (an attention module's ``attention_dropout``) and the config's fields, its text config's too
    (Gemma 3 reads ``config.attention_dropout`` in its forward). Returns the config's rates that were above 0."""
    changed: list[ConfigRate] = []
    config = getattr(model, "config", None)
    for part in [] if config is None else _config_parts(config):
        for name, value in list(vars(part).items()):
            if _is_rate(name, value, getattr(part, "model_type", "") or ""):
                setattr(part, name, 0.0)
                changed.append(ConfigRate(part, name, value))
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if _is_rate(name, value):
                setattr(module, name, 0.0)
    return changed


@contextmanager
def config_rates_restored(rates: list[ConfigRate]) -> Iterator[None]:
    """The config's rates as the model came (a checkpoint's ``config.json`` is the model's, not this trainer's setting),
    then back to 0."""
    for rate in rates:
        setattr(rate.part, rate.name, rate.value)
    try:
        yield
    finally:
        for rate in rates:
            setattr(rate.part, rate.name, 0.0)
