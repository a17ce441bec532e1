"""LoRA adapters with random ``lora_B`` on a real model (fresh adapters are a no-op), for the LoRA and merge tests."""

from __future__ import annotations

from pathlib import Path

import torch

from nemo_like.config.schema import LoraConfig
from nemo_like.models import lora
from nemo_like.models.loading import load_causal_lm


def random_adapters(base: str | Path, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """``base`` with rank-4 adapters (alpha 8) whose ``lora_B`` is random, in eval mode, and the adapters' tensors under
    the names a checkpoint saves them by."""
    torch.manual_seed(seed)
    model = lora.apply_lora(load_causal_lm(str(base)), LoraConfig(enabled=True, dim=4, alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    model.eval()
    return model, {lora.saved_name(k): v for k, v in model.state_dict().items() if lora.is_adapter(k)}
