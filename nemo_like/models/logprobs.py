"""Per-token log-probabilities of a model's forward in the project's ``[B, S]`` layout, under the sampler's distribution.

The logits -> logprobs transform (temperature, top-k, top-p, and the rule for tokens outside the kept set) lives
in :mod:`nemo_like.models.processed_logprobs`; its names are importable from here too. :func:`sequence_logprobs_with_outside`
runs the model, with the full logits or chunked (:mod:`nemo_like.models.chunked_logprobs`).
"""

from __future__ import annotations

import torch

from nemo_like.models.chunked_logprobs import model_token_logprobs_with_outside
from nemo_like.models.processed_logprobs import (
    CHUNK_ELEMENTS,
    SamplingDistribution,
    gather_token_logprobs,
    processed_token_logprobs,
    processed_token_logprobs_with_outside,
    sampling_keep_mask,
    token_logprobs_from_logits,
)

__all__ = [
    "CHUNK_ELEMENTS",
    "SamplingDistribution",
    "gather_token_logprobs",
    "processed_token_logprobs",
    "processed_token_logprobs_with_outside",
    "sampling_keep_mask",
    "sequence_logprobs",
    "sequence_logprobs_with_outside",
    "token_logprobs_from_logits",
]


def sequence_logprobs_with_outside(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    dist: SamplingDistribution,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward ``model`` on right-padded sequences: ``[B, S]`` token logprobs under ``dist`` and the
    ``[B, S]`` flags of tokens outside the sampler's kept set (both 0 at padding and position 0).
    ``chunk_size``: compute them from the hidden states ``chunk_size`` positions at a time (see
    :mod:`nemo_like.models.chunked_logprobs`); ``None`` materialises the full logits. A token is scored only after a
    real one (a left-padded row's first token, predicted from padding, is 0 as position 0 is)."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    lp, outside = model_token_logprobs_with_outside(model, input_ids, attention_mask, position_ids, dist, chunk_size)
    real = attention_mask.bool()
    valid = real & torch.nn.functional.pad(real[:, :-1], (1, 0), value=False)
    return lp * valid, outside & valid


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Forward ``model`` on right-padded sequences and return ``[B, S]`` token logprobs."""
    dist = SamplingDistribution(temperature, top_k, top_p)
    return sequence_logprobs_with_outside(model, input_ids, attention_mask, dist, chunk_size)[0]
