"""The policy trains without the model's own dropout.

Generation samples in eval mode (no dropout), so the distribution the policy gradient is about is the dropout-free
one; and the training forward runs in train mode, where a model whose config sets ``attention_dropout`` (or GPT-2's
``*_pdrop``) would drop out: a skipped prev-logprob pass (one optimizer step per rollout) would then stand for a
forward it does not equal (the loss changed, the ratio-clip warnings and the divergence metrics measured dropout
noise). LoRA's own dropout (``policy.lora_cfg.dropout``) is PEFT's, added after this, and planned for.
"""

from __future__ import annotations

import torch


def _is_rate(name: str, value: object) -> bool:
    return isinstance(value, float) and value > 0 and ("dropout" in name or name.endswith("pdrop"))


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Set every dropout rate of ``model`` to 0: its ``nn.Dropout`` modules, the rates modules copied from the config
    when they were built (an attention module's ``attention_dropout``) and the config's fields (its text config's too).
    Returns the config fields that were above 0, as ``name=value``."""
    changed: list[str] = []
    config = getattr(model, "config", None)
    configs = [] if config is None else [config, *([config.get_text_config()] if hasattr(config, "get_text_config") else [])]
    for part in {id(c): c for c in configs}.values():
        for name, value in list(vars(part).items()):
            if _is_rate(name, value):
                setattr(part, name, 0.0)
                changed.append(f"{name}={value:g}")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if _is_rate(name, value):
                setattr(module, name, 0.0)
    return changed
