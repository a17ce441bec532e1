"""A multimodal model trained on text: the parts a text-only forward never reaches (vision and audio towers, their
projectors: Gemma 3's ``vision_tower`` and ``multi_modal_projector``) get no gradient, so they are frozen. The run then
counts, plans and optimises what it trains: the trainable-parameters line and the memory plan counted them, and AdamW's
groups listed them (their update was already none: AdamW skips a parameter without a gradient)."""

from __future__ import annotations

from typing import Any

import torch


def multimodal(config: Any) -> bool:
    """Whether a transformers ``config`` is a multimodal model's: it holds a text config of its own."""
    return config is not None and hasattr(config, "get_text_config") and config.get_text_config() is not config


def text_path_parameters(model: torch.nn.Module) -> set[int] | None:
    """The ids of ``model``'s parameters on its text path when its config is :func:`multimodal`: those of the decoder
    ``get_decoder()`` returns and of the input and output embeddings; ``None`` (every one) for a text model."""
    if not multimodal(getattr(model, "config", None)):
        return None
    path = (model.get_decoder(), model.get_input_embeddings(), model.get_output_embeddings())
    return {id(p) for module in path if module is not None for p in module.parameters()}


def freeze_outside_text_path(model: torch.nn.Module) -> int:
    """Freeze ``model``'s parameters outside its text path (:func:`text_path_parameters`). Returns how many values it
    froze (0 for a text model, or a multimodal config's text-only class: Llama 4's, Qwen3.5's)."""
    reached = text_path_parameters(model)
    frozen = 0
    for param in model.parameters() if reached is not None else ():
        if id(param) not in reached and param.requires_grad:
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen
