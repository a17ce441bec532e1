"""Per-token log-probabilities in the project's ``[B, S]`` layout."""

from __future__ import annotations

import torch


def gather_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``out[b, t] = log softmax(logits[b, t-1] / T)[input_ids[b, t]]`` for t >= 1; ``out[:, 0] = 0``.

    The temperature matches the generation engine's sampling distribution, so generation and
    training logprobs are the same quantity.
    """
    logits = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:]
    # log_softmax(x)[y] = x[y] - logsumexp(x): avoids materialising the full [B, S, V] log_softmax twice.
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.nn.functional.pad(picked, (1, 0), value=0.0)


def sequence_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Forward ``model`` on right-padded sequences and return ``[B, S]`` token logprobs."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return gather_token_logprobs(logits, input_ids, temperature) * attention_mask
