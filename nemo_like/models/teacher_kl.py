"""The per-token KL between the student's and a teacher's next-token distributions, and its gradient.

For one position with student logits ``z`` and teacher logits ``t`` over the vocabulary, the term compares two
categorical distributions over a *support*:

* ``full``: the whole vocabulary, ``P_S = softmax(z)``, ``P_T = softmax(t)``;
* ``teacher_top_k`` / ``student_top_k``: the ``k`` tokens ``I`` most likely under the teacher / the student (chosen
  without gradient) plus one *tail* category holding the rest of the mass, ``1 - sum_{v in I} P(v)``. Both
  distributions are coarsened the same way, so the result is a proper KL between two ``(k+1)``-category
  distributions: ``>= 0``, 0 exactly when they agree on the support, and ``<= `` the full-vocabulary KL (the
  data-processing inequality: merging categories never increases a KL). ``k >= vocab`` has no tail: the full KL.

Directions: ``forward`` is ``KL(P_T || P_S) = sum_c P_T(c) (log P_T(c) - log P_S(c))`` (mode-covering, GKD's
default); ``reverse`` is ``KL(P_S || P_T) = sum_c P_S(c) (log P_S(c) - log P_T(c))`` (mode-seeking).

A coarsened distribution is the softmax of its *category logits* ``a = [z_I, logsumexp(z_rest)]`` (``z`` itself for
``full``), so the gradient with respect to ``a`` has the usual closed forms (``q = softmax(a)``, ``p`` the teacher's):

    forward:  dKL/da = q - p                 reverse:  dKL/da_c = q_c (log q_c - log p_c - KL)

and it flows to ``z`` unchanged on ``I`` and through ``d logsumexp(z_rest) / dz_v = softmax(z_rest)_v`` on the rest.
The gradient is written out (:func:`token_kl` with ``with_grad``) rather than left to autograd: a teacher identical
to the student then gives exactly 0 (``q - p`` and ``log q - log p`` are 0 bit for bit), where autograd's
``p - p * sum(p)`` leaves float dust that AdamW would turn into a real step.

:class:`ChunkedTeacherKL` computes the term from the last hidden states and both output heads ``chunk`` positions at
a time, saving only those and recomputing each chunk's logits in the backward pass (never ``[tokens, vocab]`` for the
batch); :class:`TeacherKLFromLogits` is the same term over logits already materialised (the unchunked forward).
The term uses the *raw* distributions (temperature 1, no top-k/top-p): it pulls the model itself toward the teacher,
whatever the sampler does with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from nemo_like.models.precision import AutocastState

Direction = Literal["forward", "reverse"]
Support = Literal["full", "teacher_top_k", "student_top_k"]


@dataclass(frozen=True)
class KLTerm:
    """What the term compares: ``direction`` (forward = KL(teacher || student)), ``support`` and ``top_k`` (the size of
    a top-k support; unused for ``full``)."""

    direction: Direction = "forward"
    support: Support = "full"
    top_k: int | None = None

    def __post_init__(self) -> None:
        if self.direction not in ("forward", "reverse"):
            raise ValueError(f"unknown KL direction {self.direction!r} (forward or reverse)")
        if self.support not in ("full", "teacher_top_k", "student_top_k"):
            raise ValueError(f"unknown KL support {self.support!r} (full, teacher_top_k or student_top_k)")
        if self.support != "full" and (self.top_k is None or self.top_k < 1):
            raise ValueError(f"the {self.support} support needs top_k >= 1, got {self.top_k}")


def _support_index(student: torch.Tensor, teacher: torch.Tensor, term: KLTerm) -> torch.Tensor | None:
    """``[n, k]`` vocabulary ids of the top-k support (``None``: the full vocabulary); no gradient."""
    if term.support == "full":
        return None
    source = teacher if term.support == "teacher_top_k" else student
    return source.detach().topk(min(int(term.top_k or 0), source.shape[-1]), dim=-1).indices


def _category_logits(logits: torch.Tensor, index: torch.Tensor | None, tail: bool) -> torch.Tensor:
    """``[n, C]`` logits of the support's categories: the logits themselves (full), the picked ones, and the tail's
    ``logsumexp`` over every other token."""
    if index is None:
        return logits
    picked = logits.gather(-1, index)
    if not tail:
        return picked
    rest = logits.scatter(-1, index, float("-inf"))
    return torch.cat([picked, rest.logsumexp(-1, keepdim=True)], dim=-1)


def token_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, term: KLTerm, with_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[n]`` KL of each row of ``[n, V]`` logits (see the module docstring) and, with ``with_grad``, its ``[n, V]``
    gradient with respect to the student's logits. Computed in float32 at least (float64 inputs stay float64)."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    z, t = student_logits.detach().to(dtype), teacher_logits.detach().to(dtype)
    index = _support_index(z, t, term)
    tail = index is not None and index.shape[-1] < z.shape[-1]
    log_q = _category_logits(z, index, tail).log_softmax(-1)
    log_p = _category_logits(t, index, tail).log_softmax(-1)
    q = log_q.exp()
    if term.direction == "forward":
        p = log_p.exp()
        kl = (p * (log_p - log_q)).sum(-1)
        grad_categories = q - p if with_grad else None
    else:
        gap = log_q - log_p
        kl = (q * gap).sum(-1)
        grad_categories = q * (gap - kl.unsqueeze(-1)) if with_grad else None
    if grad_categories is None or index is None:
        return kl, grad_categories
    if tail:
        rest = z.scatter(-1, index, float("-inf"))
        within_tail = (rest - rest.logsumexp(-1, keepdim=True)).exp()  # 0 on the support
        grad = within_tail * grad_categories[:, -1:]
        grad.scatter_(-1, index, grad_categories[:, :-1])
    else:
        grad = torch.zeros_like(z).scatter_(-1, index, grad_categories)
    return kl, grad


class TeacherKLFromLogits(torch.autograd.Function):
    """``kl[n] = token_kl(student[n], teacher[n])`` over materialised ``[n, V]`` logits; gradient to the student's only."""

    @staticmethod
    def forward(ctx, student_logits, teacher_logits, term: KLTerm):  # type: ignore[override]
        kl, _ = token_kl(student_logits, teacher_logits, term)
        ctx.save_for_backward(student_logits, teacher_logits)
        ctx.term = term
        return kl

    @staticmethod
    def backward(ctx, grad_kl):  # type: ignore[override]
        student_logits, teacher_logits = ctx.saved_tensors
        _, grad = token_kl(student_logits, teacher_logits, ctx.term, with_grad=True)
        return (grad * grad_kl.unsqueeze(-1)).to(student_logits.dtype), None, None


def teacher_kl_from_logits(student_logits: torch.Tensor, teacher_logits: torch.Tensor, term: KLTerm) -> torch.Tensor:
    """``[...]`` per-position KL of ``[..., V]`` logits (the unchunked path)."""
    v = student_logits.shape[-1]
    kl = TeacherKLFromLogits.apply(student_logits.reshape(-1, v), teacher_logits.reshape(-1, v), term)
    return kl.view(student_logits.shape[:-1])


class ChunkedTeacherKL(torch.autograd.Function):
    """``kl[n] = token_kl(hidden[n] @ W.T + b, t_hidden[n] @ W_T.T + b_T)``, ``chunk`` rows at a time; gradients to the
    student's ``hidden``, ``W`` and ``b`` (the teacher's inputs are constants)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, t_hidden, t_weight, t_bias, term: KLTerm, chunk: int):  # type: ignore[override]
        out = torch.empty(hidden.shape[0], dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            student = F.linear(hidden[rows], weight, bias)
            teacher = F.linear(t_hidden[rows], t_weight, t_bias)
            out[rows], _ = token_kl(student, teacher, term)
        ctx.save_for_backward(hidden, weight, bias, t_hidden, t_weight, t_bias)
        ctx.term, ctx.chunk, ctx.autocast = term, chunk, AutocastState.current(hidden.device)
        return out

    @staticmethod
    def backward(ctx, grad_kl):  # type: ignore[override]
        hidden, weight, bias, t_hidden, t_weight, t_bias = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        summed = torch.promote_types(weight.dtype, torch.float32)  # the chunks add up in float32 at least (float64 stays)
        grad_w = torch.zeros_like(weight, dtype=summed) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=summed) if need_b and bias is not None else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h = hidden[rows]
            with ctx.autocast():  # the forward's compute dtype: its logits, and the products autograd would run
                student = F.linear(h, weight, bias)
                teacher = F.linear(t_hidden[rows], t_weight, t_bias)
                _, grad = token_kl(student, teacher, ctx.term, with_grad=True)
                grad = grad * grad_kl[rows].unsqueeze(-1)  # dL/dlogits of this chunk
                if grad_h is not None:
                    grad_h[rows] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
                if grad_w is not None:
                    grad_w.add_(grad.T.to(h.dtype) @ h)  # cast as it adds: no float32 copy of the chunk's gradient
            if grad_b is not None:
                grad_b.add_(grad.sum(0))
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def chunked_teacher_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    t_hidden: torch.Tensor,
    t_weight: torch.Tensor,
    t_bias: torch.Tensor | None,
    term: KLTerm,
    chunk: int,
) -> torch.Tensor:
    """``[n]`` per-position KL from ``[n, H]`` student and ``[n, H_T]`` teacher hidden states and their output heads."""
    return ChunkedTeacherKL.apply(hidden, weight, bias, t_hidden.detach(), t_weight.detach(), t_bias, term, chunk)
