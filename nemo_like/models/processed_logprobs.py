"""The sampler's processed distribution, as logprobs: logits -> per-token log-probabilities (``[B, S]`` layout).

Generation engines sample from a *processed* distribution: logits divided by the temperature, then
top-k, then top-p (nucleus) truncation, renormalised over the kept tokens. vLLM (with
``logprobs_mode="processed_logprobs"``) reports the sampled token's logprob under that distribution,
so the trainer must score tokens the same way, or the importance ratio pi_train / pi_gen is off by
about the kept probability mass (huggingface/trl#6789).

:func:`processed_token_logprobs` is that transform. Its truncation rules are those of vLLM's
``apply_top_k_top_p`` and of transformers' ``TopKLogitsWarper`` / ``TopPLogitsWarper`` (they agree
except how a tie group cut by the nucleus boundary is split, see :func:`sampling_keep_mask`;
``tests/unit/models/test_processed_logprobs.py`` checks both):

* top-k keeps every token whose scaled logit is >= the k-th largest one (ties at the k-th value are
  all kept, so more than k tokens can survive: vLLM's PyTorch path; its CUDA Triton kernel keeps exactly k, see
  ``docs/guides/generation.md``); ``k >= V`` keeps everything;
* top-p runs on the top-k survivors: sort ascending, drop the tokens whose ascending cumulative
  probability is <= ``1 - p``, and always keep the most likely token.

**Tokens outside the kept set.** When the trainer's weights or numerics differ from the generator's
(a later optimizer step of a multi-step update, bf16 vs fp32 logits), a sampled token can fall just
outside the trainer's kept set, where its truncated logprob is ``-inf``. The rule here: such a
token is scored over *the kept set plus the token itself*, ``z_x/T - logsumexp(z_kept/T, z_x/T)``.
That is finite with finite gradients, and in the common case (a token on the boundary that the
generator kept and the trainer just dropped) it equals the generator's own value up to the
numerical difference. :func:`processed_token_logprobs_with_outside` also returns which tokens
were outside, so callers can count them (``train/outside_sampling_set_frac``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

#: Elements of one ``[rows, V]`` chunk processed at a time: bounds the sort/softmax temporaries.
CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class SamplingDistribution:
    """The sampler's processing of the logits: ``softmax(top_p(top_k(logits / temperature)))``."""

    temperature: float = 1.0
    top_k: int | None = None  # None or 0: no top-k
    top_p: float = 1.0  # 1.0: no nucleus truncation

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be None, 0 (disabled) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def scale(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits / temperature`` in float32; at temperature 1 the float32 logits themselves (``x / 1`` is ``x``
        bit for bit, gradient included), which spares a pass over ``[tokens, V]`` (a real vocabulary's largest)."""
        logits = logits.float()
        return logits if self.temperature == 1.0 else logits / self.temperature

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p removes any token (otherwise the plain tempered softmax)."""
        return bool(self.top_k) or self.top_p < 1.0


@torch.no_grad()
def sampling_keep_mask(scaled_logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """``[..., V]`` bool: the tokens the sampler may draw from temperature-scaled logits.

    Top-k, then top-p on the survivors, with the tie and boundary rules in the module docstring.
    With top-p this is vLLM's algorithm step by step (one ascending sort of the scaled logits, top-k
    applied in sorted order, then the nucleus), so that a group of equal logits split by the nucleus
    boundary is split the same way: torch's sort is not stable, and which members survive depends
    on the array sorted. (transformers sorts the top-k-masked array instead, so with top-k *and*
    top-p it may keep other members of such a group: same kept values, other token ids.)

    "vLLM's algorithm" is its PyTorch path (``apply_top_k_top_p_pytorch``: CPU, and any machine without Triton). On
    CUDA with Triton, vLLM 0.32 runs a pivot-based Triton kernel (``apply_top_k_top_p_triton``) instead, which sums
    probabilities in another order and may split a boundary tie group otherwise: a token at the nucleus boundary can
    land on the other side there (its logprob stays finite: the out-of-set rule above). Not compared on a GPU here.
    """
    vocab = scaled_logits.shape[-1]
    k = top_k if top_k and top_k < vocab else None
    if top_p >= 1.0:
        if k is None:
            return torch.ones_like(scaled_logits, dtype=torch.bool)
        return scaled_logits >= scaled_logits.topk(k, dim=-1).values[..., -1:]
    sorted_logits, order = scaled_logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = sorted_logits[..., vocab - k : vocab - k + 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # 1 - top_p in the sums' dtype, as vLLM computes it from its float32 top_p tensor (Python's double 1 - 0.9, rounded
    # to float32 after, is 2.2e-8 lower: a token whose running sum fell in between was kept here and dropped by vLLM)
    threshold = float(1 - torch.tensor(top_p, dtype=cumulative.dtype))  # a CPU scalar: no device copy (a sync on CUDA)
    drop_sorted = cumulative <= threshold  # also drops the top-k losers: their cumulative mass is 0
    drop_sorted[..., -1] = False  # the most likely token always survives
    return ~drop_sorted.scatter(-1, order, drop_sorted)


def token_logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, dist: SamplingDistribution
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, V]`` logits and ``[n]`` targets -> (``[n]`` logprobs, ``[n]`` outside-kept-set flags): the
    ``logits -> logprobs`` transform that the full and the chunked (:mod:`nemo_like.models.chunked_logprobs`) paths share."""
    scaled = dist.scale(logits)
    index = targets.unsqueeze(-1)
    picked = scaled.gather(-1, index).squeeze(-1)
    if not dist.truncates:
        return picked - torch.logsumexp(scaled, dim=-1), torch.zeros_like(targets, dtype=torch.bool)
    keep = sampling_keep_mask(scaled.detach(), dist.top_k, dist.top_p)
    outside = ~keep.gather(-1, index).squeeze(-1)
    keep.scatter_(-1, index, True)  # the out-of-set rule: normalise over kept set + the token itself
    # The mask is piecewise constant in the logits: the gradient flows through the renormalised
    # logprob z_x/T - logsumexp(z_kept/T), with zero gradient on the dropped tokens.
    kept_lse = torch.logsumexp(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    return picked - kept_lse, outside


def _logit_chunks(logits: torch.Tensor, targets: torch.Tensor, chunk_elements: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``([n, V] logits, [n] targets)`` pieces of ``[B, S, V]`` logits, in row-major order, of about ``chunk_elements``
    logits each. When whole rows fit, a block of rows flattened to ``[rows * S, V]`` (a bounded copy when the logits are
    a slice), so short rows cost one call per block, not per row; otherwise views along the sequence of one row (no
    ``[B, S, V]`` copy; unbind/split rather than indexing, so their backward assembles the gradient once)."""
    _, seq, vocab = logits.shape
    rows_per_block = chunk_elements // max(seq * vocab, 1)
    if rows_per_block >= 1:
        for block_logits, block_targets in zip(logits.split(rows_per_block), targets.split(rows_per_block)):
            yield block_logits.reshape(-1, vocab), block_targets.reshape(-1)
        return
    positions = max(1, chunk_elements // max(vocab, 1))
    for row_logits, row_targets in zip(logits.unbind(0), targets.unbind(0)):
        yield from zip(row_logits.split(positions), row_targets.split(positions))


def processed_token_logprobs_with_outside(
    logits: torch.Tensor, targets: torch.Tensor, dist: SamplingDistribution, chunk_elements: int = CHUNK_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`processed_token_logprobs` and a ``[B, S]`` bool: True where the target was outside the kept set."""
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"expected logits [B, S, V] and targets [B, S], got {tuple(logits.shape)} and {tuple(targets.shape)}")
    batch, seq, _ = logits.shape
    lps, outs = [], []
    for chunk_logits, chunk_targets in _logit_chunks(logits, targets, chunk_elements):
        lp, out = token_logprobs_from_logits(chunk_logits, chunk_targets, dist)
        lps.append(lp)
        outs.append(out)
    if not lps:
        empty = logits.new_zeros((batch, seq), dtype=torch.float32)
        return empty, torch.zeros((batch, seq), dtype=torch.bool, device=logits.device)
    return torch.cat(lps).view(batch, seq), torch.cat(outs).view(batch, seq)


def processed_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, dist: SamplingDistribution, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """``out[b, t] = log p(targets[b, t])`` under ``dist`` applied to ``logits[b, t]`` (``[B, S, V]`` -> ``[B, S]``).

    ``p`` is the sampler's renormalised truncated distribution; a target outside its kept set is
    scored over the kept set plus itself (module docstring). Gradients flow to ``logits``. Work is
    done in chunks of about ``chunk_elements`` logits, so the truncation's sort adds bounded memory.
    """
    return processed_token_logprobs_with_outside(logits, targets, dist, chunk_elements)[0]


def gather_token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0
) -> torch.Tensor:
    """``out[b, t] = log p(input_ids[b, t] | logits[b, t-1])`` for t >= 1; ``out[:, 0] = 0``.

    ``p`` is the generation engine's processed sampling distribution (temperature, top-k, top-p),
    so generation and training logprobs are the same quantity.
    """
    dist = SamplingDistribution(temperature, top_k, top_p)
    picked = processed_token_logprobs(logits[:, :-1], input_ids[:, 1:], dist)
    return torch.nn.functional.pad(picked, (1, 0), value=0.0)
