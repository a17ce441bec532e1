"""The manifest check: a refit must name exactly the parameters the engine serves.

The engine side reads the names once from a meta-device skeleton of the HF model
(:func:`expected_weight_names`) and checks every refit's names against them (:func:`check_manifest`)
before loading anything, so a renamed, missing or extra tensor fails loudly instead of leaving a
layer with stale weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class RefitManifestError(RuntimeError):
    """A refit's state dict does not name exactly the parameters the engine serves."""


def served_weight_names(model: torch.nn.Module) -> list[str]:
    """The names a refit of the loaded ``model`` must carry: its state dict's, but the rotary tables (computed from
    the config, never trained)."""
    return [k for k in model.state_dict() if not k.endswith("rotary_emb.inv_freq")]


def expected_weight_names(model_path: str) -> list[str]:
    """Every name of the HF model's ``state_dict()`` (tied ``lm_head.weight`` included), from a meta-device skeleton."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return sorted(skeleton.state_dict().keys())


def check_manifest(expected: Iterable[str], received: Iterable[str], engine: str = "the vLLM engine") -> None:
    """Raise :class:`RefitManifestError` naming the missing and the extra keys when the names differ (before anything
    is loaded: a refit that failed half-way would leave ``engine`` serving a mix of two versions)."""
    expected, received = set(expected), set(received)
    missing, extra = sorted(expected - received), sorted(received - expected)
    if missing or extra:
        raise RefitManifestError(
            f"Refit manifest does not match {engine}'s parameters: missing={missing} extra={extra} "
            f"({len(received)} tensors received, {len(expected)} expected)"
        )
