"""A refit's tensors as the model's checkpoint files hold them, which is what vLLM's ``load_weights`` reads.

transformers 5 holds some models' weights otherwise than it saves them: a mixture of experts' experts fused into
``[experts, out, in]`` parameters under other names (Mixtral's ``mlp.experts.gate_up_proj`` for the checkpoint's
``block_sparse_moe.experts.<e>.w1.weight`` and ``w3``), and ``save_pretrained`` reverts that. The policy sends the weights
it holds; the vLLM engine reverts them the same way, a tensor at a time, before loading them (transformers'
``revert_weight_conversion``; nothing to do for a model it holds as saved: the Llama family, Qwen2, Gemma).
``tests/unit/models/test_refit_checkpoint_format.py`` checks the result against ``save_pretrained``'s files.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

import torch


@functools.cache
def skeleton(model_path: str) -> torch.nn.Module:
    """The HF model of ``model_path`` on the meta device (its conversions are read from it; no weights), once per
    engine process."""
    from nemo_like.models.loading import meta_skeleton

    return meta_skeleton(model_path)


@functools.cache
def converts(model: torch.nn.Module) -> bool:
    """Whether transformers holds ``model``'s weights otherwise than its checkpoint does."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # built from a config (as revert_weight_conversion reads it then)
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return bool(conversions)


def checkpoint_tensors(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` (``model``'s state-dict names and layout) as its checkpoint holds them, a tensor at a time (a
    streamed refit stays bucket by bucket); unchanged for a model held as saved."""
    if not converts(model):
        yield from tensors
        return
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in tensors:
        yield from revert_weight_conversion(model, {name: tensor}).items()
