"""Token logprobs without the full ``[tokens, vocab]`` logits: output head + log-softmax per chunk of positions.

The model runs as usual up to its last hidden states; its output head is swapped, for the duration
of one forward, for a function that computes ``token_logprobs_from_logits`` on ``chunk_size``
positions at a time. Training keeps the graph bounded too: :class:`ChunkedTokenLogprobs` saves only
the hidden states and the head weight and recomputes each chunk's logits in the backward pass.
Swapping the head *inside* the model's forward keeps FSDP2's hooks in charge of gathering the head
weight (a sharded root module only unshards its parameters inside its own forward).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from nemo_like.models.logprobs import gather_token_logprobs, token_logprobs_from_logits


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``out[n] = token_logprobs_from_logits(hidden[n] @ W.T + b, targets[n])`` computed ``chunk`` rows at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int):  # type: ignore[override]
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[start : start + chunk], weight, bias)
            out[start : start + chunk] = token_logprobs_from_logits(logits, targets[start : start + chunk], temperature)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        hidden, weight, bias, targets = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        w = weight.detach().requires_grad_(need_w)
        b = bias.detach().requires_grad_(need_b) if bias is not None else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[start : start + ctx.chunk].detach().requires_grad_(need_h)
            with torch.enable_grad():
                lp = token_logprobs_from_logits(F.linear(h, w, b), targets[start : start + ctx.chunk], ctx.temperature)
            inputs = [t for t, need in ((h, need_h), (w, need_w), (b, need_b and b is not None)) if need]
            grads = iter(torch.autograd.grad(lp, inputs, grad_out[start : start + ctx.chunk]))
            if need_h:
                grad_h[start : start + ctx.chunk] = next(grads)
            if need_w:
                grad_w += next(grads)
            if grad_b is not None:
                grad_b += next(grads)
        return grad_h, grad_w, grad_b, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, input_ids: torch.Tensor, temperature: float, chunk: int
) -> torch.Tensor:
    """``[B, S]`` logprobs (column 0 = 0) of ``input_ids`` from ``[B, S, H]`` last hidden states and the output head."""
    b, s, h = hidden.shape
    flat_h = hidden[:, :-1].reshape(-1, h)
    flat_t = input_ids[:, 1:].reshape(-1)
    picked = ChunkedTokenLogprobs.apply(flat_h, weight, bias, flat_t, temperature, chunk).view(b, s - 1)
    return F.pad(picked, (1, 0), value=0.0)


@contextmanager
def _chunked_head(model: torch.nn.Module, input_ids: torch.Tensor, temperature: float, chunk: int) -> Iterator[None]:
    """Make the model's output head return ``[B, S]`` token logprobs instead of ``[B, S, V]`` logits."""
    head = model.get_output_embeddings()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return chunked_token_logprobs(hidden, head.weight, head.bias, input_ids, temperature, chunk)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def model_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``[B, S]`` token logprobs (unmasked; column 0 = 0) of one forward; ``attention_mask`` may be 2D or a 4D additive mask."""
    if chunk_size is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        return gather_token_logprobs(logits, input_ids, temperature)
    with _chunked_head(model, input_ids, temperature, chunk_size):
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
