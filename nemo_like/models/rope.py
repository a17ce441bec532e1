"""A model config's rotary position embedding: its type, and how long its frequencies stay the pretrained ones."""

from __future__ import annotations

from typing import Any

# RoPE types whose frequencies depend on the longest position a forward computes: transformers recomputes them from
# each forward's longest position once it passes the pretrained context ("dynamic" NTK scaling past
# max_position_embeddings, "longrope" switching to its long factors past original_max_position_embeddings).
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """The config's RoPE settings (``rope_parameters`` in transformers 5, ``rope_scaling`` before; empty when unset)."""
    return dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})


def rope_type(cfg: Any) -> str:
    """The config's RoPE type ("default" when unset)."""
    params = rope_parameters(cfg)
    return str(params.get("rope_type", params.get("type", "default")))


def fixed_frequency_length(cfg: Any) -> int | None:
    """For a position-dependent RoPE (:data:`POSITION_DEPENDENT_ROPE`), the longest sequence a forward computes with the
    pretrained frequencies; None for any other RoPE (its frequencies never change)."""
    kind = rope_type(cfg)
    if kind not in POSITION_DEPENDENT_ROPE:
        return None
    positions = getattr(cfg, "max_position_embeddings", None)
    if kind == "longrope":
        positions = (
            rope_parameters(cfg).get("original_max_position_embeddings")
            or getattr(cfg, "original_max_position_embeddings", None)
            or positions
        )
    return int(positions) if positions else None
