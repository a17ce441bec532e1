"""Token logprobs without the full ``[tokens, vocab]`` logits: output head + log-softmax per chunk of positions.

The model runs as usual up to its last hidden states; its output head is swapped, for the duration
of one forward, for a function that computes :func:`~nemo_like.models.processed_logprobs.token_logprobs_from_logits`
(the sampler's processed distribution: temperature, top-k, top-p) on ``chunk_size`` positions at a
time. Training keeps the graph bounded too: :class:`ChunkedTokenLogprobs` saves only the hidden
states and the head weight and recomputes each chunk's logits in the backward pass. Swapping the
head *inside* the model's forward keeps FSDP2's hooks in charge of gathering the head weight (a
sharded root module only unshards its parameters inside its own forward).

With a teacher (the KL loss term, :mod:`nemo_like.models.teacher_kl`), the teacher's forward keeps its last hidden
states and output head (:func:`teacher_head_inputs`), and the student's swapped head adds each position's KL to the
teacher beside its logprob (:func:`model_token_logprobs_and_teacher_kl`), chunked the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nemo_like.models.precision import AutocastState
from nemo_like.models.processed_logprobs import SamplingDistribution, processed_token_logprobs_with_outside, token_logprobs_from_logits
from nemo_like.models.teacher_kl import KLTerm, chunked_teacher_kl, teacher_kl_from_logits


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``(out[n], outside[n]) = token_logprobs_from_logits(hidden[n] @ W.T + b, targets[n], dist)``, ``chunk`` rows at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, dist: SamplingDistribution, chunk: int):  # type: ignore[override]
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        outside = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[start : start + chunk], weight, bias)
            out[start : start + chunk], outside[start : start + chunk] = token_logprobs_from_logits(
                logits, targets[start : start + chunk], dist
            )
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.dist, ctx.chunk, ctx.autocast = dist, chunk, AutocastState.current(hidden.device)
        ctx.mark_non_differentiable(outside)
        return out, outside

    @staticmethod
    def backward(ctx, grad_out, _grad_outside):  # type: ignore[override]
        hidden, weight, bias, targets = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # The chunks' weight gradients add up in float32 and round once (a bf16 weight, FSDP2's compute copy, rounded
        # the running sum at every chunk: 0.7 % off float64 at 32 chunks against 0.2 % unchunked)
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b and bias is not None else None
        w = weight.detach().requires_grad_(need_w)
        b = bias.detach().requires_grad_(need_b) if bias is not None else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[start : start + ctx.chunk].detach().requires_grad_(need_h)
            with torch.enable_grad(), ctx.autocast():  # the forward's compute dtype: the same function's gradient
                lp, _ = token_logprobs_from_logits(F.linear(h, w, b), targets[start : start + ctx.chunk], ctx.dist)
            inputs = [t for t, need in ((h, need_h), (w, need_w), (b, need_b and b is not None)) if need]
            grads = iter(torch.autograd.grad(lp, inputs, grad_out[start : start + ctx.chunk]))
            if need_h:
                grad_h[start : start + ctx.chunk] = next(grads)
            if need_w:
                grad_w.add_(next(grads))  # cast as it adds: no float32 copy of the chunk's gradient
            if grad_b is not None:
                grad_b.add_(next(grads))
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input_ids: torch.Tensor,
    dist: SamplingDistribution,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S]`` logprobs and outside-kept-set flags (column 0 = 0) of ``input_ids`` from ``[B, S, H]`` last
    hidden states and the output head."""
    b, s, h = hidden.shape
    flat_h = hidden[:, :-1].reshape(-1, h)
    flat_t = input_ids[:, 1:].reshape(-1)
    picked, outside = ChunkedTokenLogprobs.apply(flat_h, weight, bias, flat_t, dist, chunk)
    return F.pad(picked.view(b, s - 1), (1, 0), value=0.0), F.pad(outside.view(b, s - 1), (1, 0), value=False)


@dataclass
class TeacherOutputs:
    """A frozen teacher's forward over a batch, as the KL term needs it: its ``[B, S, V]`` logits (unchunked), or its
    ``[B, S, H]`` last hidden states and output head (chunked: the logits are computed a chunk at a time)."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None


@torch.no_grad()
def teacher_head_inputs(
    teacher: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    chunk_size: int | None,
    copy_head: bool,
) -> TeacherOutputs:
    """Run ``teacher`` (no gradient) on the student's exact inputs; ``copy_head``: copy the head's weights out of the
    forward (a sharded model frees its gathered parameters once its forward returns)."""
    if chunk_size is None:
        return TeacherOutputs(logits=teacher(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits)
    head = teacher.get_output_embeddings()
    out = TeacherOutputs()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        weight, bias = head.weight.detach(), head.bias.detach() if head.bias is not None else None
        out.hidden = hidden
        out.weight = weight.clone() if copy_head else weight
        out.bias = bias.clone() if copy_head and bias is not None else bias
        out.logits = hidden[..., :1]  # what the head returned: the forward must pass it on unchanged (then dropped)
        return out.logits

    head.forward = forward
    try:
        returned = teacher(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    finally:
        del head.forward
    check_head_output_unchanged(teacher, out.logits, returned)
    out.logits = None
    return out


Head = tuple[torch.Tensor, "torch.Tensor | None"]


def common_vocabulary(student: Head, teacher: Head) -> tuple[Head, Head]:
    """Both output heads (weight, bias) cut to the rows they share. Models of one family pad their vocabularies to
    different sizes (Qwen2.5-0.5B: 151,936 rows, 7B: 152,064; both tokenizers: 151,665 tokens), and the shared
    tokenizer's ids all lie in the first ``min`` rows: the KL term compares the two distributions over them (each
    renormalised without the larger head's extra rows; the smaller head's own padding rows, which no token id reaches,
    stay in both)."""
    vocab = min(student[0].shape[0], teacher[0].shape[0])

    def cut(head: Head) -> Head:
        weight, bias = head
        if weight.shape[0] == vocab:
            return head
        return weight[:vocab], None if bias is None else bias[:vocab]

    return cut(student), cut(teacher)


def check_head_output_unchanged(model: torch.nn.Module, produced: torch.Tensor, returned: torch.Tensor) -> None:
    """Raise when ``model``'s forward returned something else than its output head ``produced``: it post-processes the
    head's logits (scales, caps) under a config field :data:`~nemo_like.models.loading.HEAD_POSTPROCESSING` does not
    know, so the chunked path, which replaces the head, computes another distribution than the model samples from. A
    dtype cast of the same values passes."""
    if returned is produced:
        return
    if returned.shape == produced.shape:
        cast = produced.to(returned.dtype)
        if bool(((returned == cast) | (returned.isnan() & cast.isnan())).all()):  # a NaN is the model's, not a change
            return
    raise RuntimeError(
        f"{type(model).__name__}'s forward changes its output head's logits (a scale or a cap its config.json names "
        "under a field nemo_like does not know), which the chunked logprob path leaves out: its logprobs would be "
        "those of another distribution than the model samples from. Set policy.logprob_chunk_size=null (a teacher "
        "shares it)"
    )


@contextmanager
def _chunked_head(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    dist: SamplingDistribution,
    chunk: int,
    teacher: TeacherOutputs | None = None,
    term: KLTerm | None = None,
) -> Iterator[list[torch.Tensor]]:
    """Make the model's output head return ``[B, S, 2]``: token logprobs and outside flags instead of logits (and, with
    ``teacher``, ``[B, S, 3]``: each position's KL to the teacher under ``term`` last; column 0 = 0). Yields a list
    that holds what the head returned, for :func:`check_head_output_unchanged`."""
    head = model.get_output_embeddings()
    produced: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        lp, outside = chunked_token_logprobs(hidden, head.weight, head.bias, input_ids, dist, chunk)
        columns = [lp, outside.to(lp.dtype)]
        if teacher is not None:
            b, s, h = hidden.shape
            t_hidden = teacher.hidden[:, :-1].reshape(b * (s - 1), -1)
            (weight, bias), (t_weight, t_bias) = common_vocabulary((head.weight, head.bias), (teacher.weight, teacher.bias))
            kl = chunked_teacher_kl(hidden[:, :-1].reshape(-1, h), weight, bias, t_hidden, t_weight, t_bias, term, chunk)
            columns.append(F.pad(kl.view(b, s - 1), (1, 0), value=0.0).to(lp.dtype))
        produced.append(torch.stack(columns, dim=-1))
        return produced[-1]

    head.forward = forward
    try:
        yield produced
    finally:
        del head.forward


def _as_distribution(dist: SamplingDistribution | float) -> SamplingDistribution:
    return dist if isinstance(dist, SamplingDistribution) else SamplingDistribution(temperature=float(dist))


def model_token_logprobs_with_outside(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    dist: SamplingDistribution | float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S]`` token logprobs and outside-kept-set flags (unmasked; column 0 = 0/False) of one forward under
    ``dist`` (a :class:`SamplingDistribution`, or a temperature); ``attention_mask`` may be 2D or a 4D additive mask."""
    dist = _as_distribution(dist)
    if chunk_size is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        lp, outside = processed_token_logprobs_with_outside(logits[:, :-1], input_ids[:, 1:], dist)
        return F.pad(lp, (1, 0), value=0.0), F.pad(outside, (1, 0), value=False)
    with _chunked_head(model, input_ids, dist, chunk_size) as produced:
        packed = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    check_head_output_unchanged(model, produced[-1], packed)
    return packed[..., 0], packed[..., 1].bool()


def model_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    dist: SamplingDistribution | float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The logprobs of :func:`model_token_logprobs_with_outside`."""
    return model_token_logprobs_with_outside(model, input_ids, attention_mask, position_ids, dist, chunk_size)[0]


def model_token_logprobs_and_teacher_kl(
    model: torch.nn.Module,
    teacher: TeacherOutputs,
    term: KLTerm,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    dist: SamplingDistribution | float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`model_token_logprobs_with_outside` and the ``[B, S]`` per-position KL to ``teacher`` (the
    :func:`teacher_head_inputs` of the same inputs; entry t compares the distributions of token t, column 0 = 0,
    unmasked), differentiable with respect to the student. The KL uses the raw distributions (see
    :mod:`nemo_like.models.teacher_kl`), the logprobs ``dist``."""
    dist = _as_distribution(dist)
    if chunk_size is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        lp, outside = processed_token_logprobs_with_outside(logits[:, :-1], input_ids[:, 1:], dist)
        vocab = min(logits.shape[-1], teacher.logits.shape[-1])  # see common_vocabulary
        kl = teacher_kl_from_logits(logits[:, :-1, :vocab], teacher.logits[:, :-1, :vocab], term)
        return F.pad(lp, (1, 0), value=0.0), F.pad(outside, (1, 0), value=False), F.pad(kl, (1, 0), value=0.0)
    with _chunked_head(model, input_ids, dist, chunk_size, teacher, term) as produced:
        packed = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    check_head_output_unchanged(model, produced[-1], packed)
    return packed[..., 0], packed[..., 1].bool(), packed[..., 2]
