"""Per-token log-probabilities in the project's ``[B, S]`` layout."""

from __future__ import annotations

import torch


def token_logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / T)[..., targets]``: the ``logits -> logprobs`` transform at each position.

    ``logits`` is ``[..., V]``, ``targets`` is ``[...]``. Both the full and the chunked paths
    (:mod:`nemo_like.models.chunked_logprobs`) call this, so a change of the transform applies to both.
    """
    logits = logits.float() / temperature
    # log_softmax(x)[y] = x[y] - logsumexp(x): avoids materialising the full log_softmax.
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def gather_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``out[b, t] = log softmax(logits[b, t-1] / T)[input_ids[b, t]]`` for t >= 1; ``out[:, 0] = 0``.

    The temperature matches the generation engine's sampling distribution, so generation and
    training logprobs are the same quantity.
    """
    picked = token_logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature)
    return torch.nn.functional.pad(picked, (1, 0), value=0.0)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Forward ``model`` on right-padded sequences and return ``[B, S]`` token logprobs.

    ``chunk_size``: compute them in chunks of positions from the hidden states (see
    :mod:`nemo_like.models.chunked_logprobs`); ``None`` materialises the full logits.
    """
    from nemo_like.models.chunked_logprobs import model_token_logprobs

    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    lp = model_token_logprobs(model, input_ids, attention_mask, position_ids, temperature, chunk_size)
    return lp * attention_mask
