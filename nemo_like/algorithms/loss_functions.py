"""Clipped policy-gradient loss for GRPO (PPO-style), with NeMo-RL's options.

Notation, per token ``t`` of a ``[B, S]`` batch aligned with ``input_ids``: ``c`` = log pi_curr
(with gradient), ``p`` = log pi_prev (the policy the rollout batch was scored with; ``stopgrad(c)``
when absent or when ``force_on_policy_ratio``), ``g`` = log pi_gen (the generation engine), ``A`` =
advantage. The loss is composed of small pure functions, one per concern:

1. :func:`ppo_log_ratio` - log of the ratio pi_curr/pi_prev (per token, or per sequence for GSPO);
2. a surrogate from :data:`SURROGATES` - PPO clip (+ dual clip), unclipped (trust region), CISPO or
   REINFORCE - giving the per-token policy-gradient loss;
3. :func:`importance_log_weights` + a truncation from :data:`TRUNCATIONS` - the pi_prev/pi_gen
   correction, optionally truncated (tis, icepop, seq-mask-tis);
4. a trust region from :data:`TRUST_REGIONS` - which tokens are kept (dppo_binary_tv);
5. :func:`reference_kl_per_token` - the KL penalty to the reference policy (k1/k2/k3);
6. :func:`reduce_per_token` - the loss aggregation (``loss_fn.loss_aggregation``: token-mean,
   seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-sum), always normalised
   by counts over the global batch so micro-batching and data parallelism do not change it.

Surrogates, truncations, trust regions and KL estimators live in :class:`Registry` objects: a
recipe names a registered entry, or user code by ``module:function``.

``docs/guides/grpo.md`` ("Loss function", "Metrics") documents the maths and every metric.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from nemo_like.algorithms.kl import KL_ESTIMATORS, PATHWISE_KL_ESTIMATORS
from nemo_like.algorithms.metrics import (
    SEQUENCE_MEAN_METRICS,
    Reduction,
    combine_metric_fragments,
    combine_optimizer_steps,
    default_metric_reduction,
    divergence_metric_fragments,
)
from nemo_like.algorithms.utils import masked_mean
from nemo_like.config.loss import LOSS_AGGREGATIONS, ClippedPGLossConfig
from nemo_like.utils.registry import Registry

__all__ = [
    "ClippedPGLossFn",
    "LossInputs",
    "combine_metric_fragments",
    "reduce_per_token",
    "ppo_log_ratio",
    "importance_log_weights",
    "reference_kl_per_token",
    "dppo_binary_tv_keep_mask",
    "SURROGATES",
    "TRUNCATIONS",
    "TRUST_REGIONS",
    "KL_ESTIMATORS",
]


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossInputs:
    """The tensors of one microbatch, masked so that invalid positions hold 0.

    Zeroing invalid positions (prompt, padding, position 0, masked samples) before any ``exp``
    keeps garbage there from turning into inf/NaN, and gives those positions an exactly zero
    gradient.
    """

    curr: torch.Tensor  # [B, S] log pi_curr, with gradient
    prev: torch.Tensor  # [B, S] log pi_prev, detached
    gen: torch.Tensor  # [B, S] log pi_gen, detached
    ref: torch.Tensor | None  # [B, S] log pi_ref, detached, or None
    advantages: torch.Tensor  # [B, S]
    mask: torch.Tensor  # [B, S] float, token_mask * sample_mask[:, None]
    valid: torch.Tensor  # [B, S] bool, mask > 0
    sample_mask: torch.Tensor  # [B] float
    global_valid_toks: torch.Tensor
    global_valid_seqs: torch.Tensor

    @classmethod
    def from_data(
        cls,
        curr_logprobs: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
        force_on_policy_ratio: bool = False,
    ) -> LossInputs:
        """Build the inputs from the loss call's arguments (see :class:`ClippedPGLossFn`)."""
        for key in ("generation_logprobs", "advantages", "token_mask", "sample_mask"):
            if key not in data:
                raise KeyError(f"ClippedPGLossFn needs data[{key!r}]")
        # bf16/fp16 logprobs are upcast: exp() of small differences needs fp32 precision.
        dtype = torch.promote_types(curr_logprobs.dtype, torch.float32)
        device = curr_logprobs.device
        sample_mask = data["sample_mask"].to(dtype)
        mask = data["token_mask"].to(dtype) * sample_mask[:, None]
        if mask.shape != curr_logprobs.shape or sample_mask.shape != curr_logprobs.shape[:1]:
            raise ValueError(
                f"shape mismatch: curr_logprobs {tuple(curr_logprobs.shape)}, token_mask "
                f"{tuple(data['token_mask'].shape)}, sample_mask {tuple(sample_mask.shape)}"
            )
        for key in ("advantages", "generation_logprobs", "prev_logprobs", "reference_policy_logprobs"):
            if data.get(key) is not None and tuple(data[key].shape) != tuple(curr_logprobs.shape):
                # a [B] advantage broadcast along the sequence without an error where B == S
                raise ValueError(
                    f"data[{key!r}] has shape {tuple(data[key].shape)}, expected {tuple(curr_logprobs.shape)} ([B, S] like curr_logprobs)"
                )
        valid = mask > 0

        def masked(tensor: torch.Tensor) -> torch.Tensor:
            return torch.where(valid, tensor.to(dtype), 0.0)

        prev = data.get("prev_logprobs")
        if force_on_policy_ratio or prev is None:
            prev = curr_logprobs
        ref = data.get("reference_policy_logprobs")
        return cls(
            curr=masked(curr_logprobs),
            prev=masked(prev.detach()),
            gen=masked(data["generation_logprobs"].detach()),
            ref=None if ref is None else masked(ref.detach()),
            advantages=masked(data["advantages"].detach()),
            mask=mask,
            valid=valid,
            sample_mask=sample_mask,
            global_valid_toks=torch.as_tensor(global_valid_toks, dtype=dtype, device=device),
            global_valid_seqs=torch.as_tensor(global_valid_seqs, dtype=dtype, device=device),
        )


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return masked_mean(values, mask, dim=dim, global_normalization_factor=1.0)


def reduce_per_token(
    values: torch.Tensor,
    inputs: LossInputs,
    aggregation: str | bool,
    normalizer: float | None = None,
) -> torch.Tensor:
    """Aggregate per-token values of one microbatch; summing over microbatches and ranks gives
    the full-batch value, because every divisor is a global count or a constant.

    With ``N`` valid tokens and ``M`` valid sequences in the global batch, ``T_i`` the valid tokens
    of sequence ``i`` and ``C`` = ``normalizer``:

    * ``token-mean``: ``sum_i sum_t v / N``
    * ``seq-mean-token-mean``: ``sum_i (sum_t v / T_i) / M``
    * ``seq-mean-token-sum``: ``sum_i sum_t v / M``
    * ``seq-mean-token-sum-norm`` (Dr. GRPO): ``sum_i sum_t v / (M C)``
    * ``token-sum``: ``sum_i sum_t v``

    ``aggregation`` may also be a bool (NeMo-RL's ``token_level_loss``: True = token-mean,
    False = seq-mean-token-mean).
    """
    if isinstance(aggregation, bool):
        aggregation = "token-mean" if aggregation else "seq-mean-token-mean"
    if aggregation == "token-mean":
        return masked_mean(values, inputs.mask, global_normalization_factor=inputs.global_valid_toks)
    if aggregation == "token-sum":
        return _masked_sum(values, inputs.mask)
    if aggregation == "seq-mean-token-mean":
        per_sequence = masked_mean(values, inputs.mask, dim=-1)
    elif aggregation in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        per_sequence = _masked_sum(values, inputs.mask, dim=-1)
        if aggregation == "seq-mean-token-sum-norm":
            if normalizer is None:
                raise ValueError(
                    "loss_fn.loss_aggregation='seq-mean-token-sum-norm' needs "
                    "loss_fn.loss_aggregation_normalizer (the constant C, e.g. the maximum response length)"
                )
            per_sequence = per_sequence / normalizer
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; expected one of {list(LOSS_AGGREGATIONS)}")
    return masked_mean(per_sequence, inputs.sample_mask, global_normalization_factor=inputs.global_valid_seqs)


def _token_mean(values: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    return reduce_per_token(values, inputs, "token-mean")


def _as_per_token(values: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sequence [B] tensor over tokens; leave [B, S] tensors alone."""
    return values[:, None] if values.dim() == 1 else values


# --------------------------------------------------------------------------------------------
# 1. Ratio
# --------------------------------------------------------------------------------------------


def ppo_log_ratio(inputs: LossInputs, sequence_level: bool) -> torch.Tensor:
    """log(pi_curr/pi_prev) per token, or GSPO's per-sequence mean broadcast over valid tokens."""
    log_ratio = inputs.curr - inputs.prev
    if not sequence_level:
        return log_ratio
    per_sequence = masked_mean(log_ratio, inputs.mask, dim=-1)
    return torch.where(inputs.valid, per_sequence[:, None].expand_as(log_ratio), 0.0)


# --------------------------------------------------------------------------------------------
# 2. Surrogates
# --------------------------------------------------------------------------------------------


def plugin_output_error(key: str, value: object, expected: str) -> ValueError:
    """The error for a loss plug-in (a user's, named by import path) whose output is not what the loss uses: it had
    failed deep in the loss (an AttributeError, a dtype error), or, broadcast, computed another loss."""
    shape = f" of shape {dims(value.shape)} and dtype {value.dtype}" if isinstance(value, torch.Tensor) else ""
    return ValueError(f"{key} returned a {type(value).__name__}{shape}, not {expected}")


def dims(shape: torch.Size) -> str:
    """A shape as the errors write it: ``[8, 40]``."""
    return f"[{', '.join(map(str, shape))}]"


class Surrogate(NamedTuple):
    """Per-token policy-gradient loss, the ratio and clamped ratio it used, and where it clipped."""

    loss: torch.Tensor
    ratio: torch.Tensor
    ratio_clamped: torch.Tensor
    clipped: torch.Tensor  # bool


SurrogateFn = Callable[[torch.Tensor, LossInputs, ClippedPGLossConfig], Surrogate]


def exp_limit(dtype: torch.dtype) -> float:
    """The largest ``x`` whose ``exp(x)`` stays a margin (a factor e) inside ``dtype``'s range (~87.7 in float32)."""
    return math.log(torch.finfo(dtype).max) - 1.0


def hold_limit(values: torch.Tensor) -> float:
    """The largest log-value ``values`` may hold so that a sum over all of them stays finite: :func:`exp_limit` less
    the log of their count (~77 nats at 64k float32 tokens)."""
    return exp_limit(values.dtype) - math.log(max(values.numel(), 1))


def ratio_of(log_ratio: torch.Tensor, advantages: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exp(log_ratio), held)``: where ``|A| r`` could overflow the loss (its dtype's largest value over e and over
    the tokens of the batch, so that their sum cannot either; a log-ratio above ~77 nats in float32 at 64k tokens and
    ``|A| <= 1``), the log-ratio is held there, detached. Past exp's range the ratio and exp's derivative were inf, and a
    clipped token's zero gradient (or an importance weight of 0) times inf was a NaN that skipped the whole step; just
    below it, ``-A r`` overflowed instead. A held token gets no gradient (as the KL term's overflowing tokens), its loss
    is held at 0 by the surrogates and it counts as clipped; ``advantages``: the ``A`` the ratio is multiplied by."""
    limit = hold_limit(log_ratio)
    size = log_ratio.detach() if advantages is None else log_ratio.detach() + advantages.detach().abs().clamp(min=1.0).log()
    held = size > limit
    kept = torch.where(held, log_ratio.detach().clamp(max=limit), log_ratio)  # no host sync on a GPU
    return torch.exp(kept), held


def _reported(ratio: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """The ratio as the metrics report it: ``exp(hold_limit)`` where it was held, a finite mark that reads as huge and
    that a mean over the tokens cannot overflow (an infinite minimum reads as "no valid token" in the combined metrics,
    and a mark of the dtype's largest value made the mean inf with two held tokens)."""
    return torch.where(held, math.exp(hold_limit(ratio)), ratio.detach())


def _clamp_ratio(ratio: torch.Tensor, cfg: ClippedPGLossConfig) -> torch.Tensor:
    return ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)


def ppo_clip_surrogate(log_ratio: torch.Tensor, inputs: LossInputs, cfg: ClippedPGLossConfig) -> Surrogate:
    """``max(-A r, -A clamp(r))``; with dual clip, capped at ``-A c`` where ``A < 0``.

    Where the clamped branch is strictly larger, the ratio is outside the band on the side the
    advantage pushes, the clamp is constant there, and the token's gradient is exactly 0.
    """
    advantages = inputs.advantages
    ratio, overflow = ratio_of(log_ratio, advantages)
    ratio_clamped = _clamp_ratio(ratio, cfg)
    unclipped_loss, clipped_loss = -advantages * ratio, -advantages * ratio_clamped
    clipped = clipped_loss > unclipped_loss
    loss = torch.where(clipped, clipped_loss, unclipped_loss)
    if cfg.ratio_clip_c is not None:
        dual_bound = -advantages * cfg.ratio_clip_c
        dual_clipped = (advantages < 0) & (dual_bound < loss)
        loss = torch.where(dual_clipped, dual_bound, loss)
        clipped = clipped | dual_clipped
    # A held token has no gradient (ratio_of): it counts as clipped, with a loss of 0
    return Surrogate(torch.where(overflow, 0.0, loss), _reported(ratio, overflow), ratio_clamped, clipped | overflow)


def unclipped_surrogate(log_ratio: torch.Tensor, inputs: LossInputs, cfg: ClippedPGLossConfig) -> Surrogate:
    """``-A r`` without clipping: the trust region decides which tokens count."""
    ratio, overflow = ratio_of(log_ratio, inputs.advantages)
    loss = torch.where(overflow, 0.0, -inputs.advantages * ratio)  # a held token: no gradient, a loss of 0
    return Surrogate(loss, _reported(ratio, overflow), _reported(ratio, overflow), torch.zeros_like(inputs.valid))


def cispo_surrogate(log_ratio: torch.Tensor, inputs: LossInputs, cfg: ClippedPGLossConfig) -> Surrogate:
    """CISPO: ``-A stopgrad(clamp(r)) log pi_curr``; clipped tokens keep a bounded gradient."""
    ratio, overflow = ratio_of(log_ratio)
    ratio_clamped = _clamp_ratio(ratio.detach(), cfg)  # bounded: its loss and gradient stay finite past exp's range
    loss = -inputs.advantages * ratio_clamped * inputs.curr
    return Surrogate(loss, _reported(ratio, overflow), ratio_clamped, ratio.detach() != ratio_clamped)


def reinforce_surrogate(log_ratio: torch.Tensor, inputs: LossInputs, cfg: ClippedPGLossConfig) -> Surrogate:
    """REINFORCE (``disable_ppo_ratio``): ``-A log pi_curr``; the ratio is reported, not used."""
    ratio = _reported(*ratio_of(log_ratio.detach()))
    return Surrogate(-inputs.advantages * inputs.curr, ratio, ratio, torch.zeros_like(inputs.valid))


#: ``loss_fn.surrogate`` names; a user surrogate has the signature of :data:`SurrogateFn`.
SURROGATES: Registry[SurrogateFn] = Registry("surrogate", "loss_fn.surrogate")
SURROGATES.add("ppo_clip", ppo_clip_surrogate)
SURROGATES.add("unclipped", unclipped_surrogate)
SURROGATES.add("cispo", cispo_surrogate)
SURROGATES.add("reinforce", reinforce_surrogate)


def select_surrogate(cfg: ClippedPGLossConfig) -> str:
    """Name (or import path) of the surrogate the config asks for: ``loss_fn.surrogate``, else
    the one selected by ``disable_ppo_ratio`` / ``use_cispo`` / ``trust_region_type``."""
    return cfg.surrogate_name


# --------------------------------------------------------------------------------------------
# 3. Importance-sampling correction pi_prev / pi_gen
# --------------------------------------------------------------------------------------------


def importance_log_weights(inputs: LossInputs, sequence_level: bool) -> torch.Tensor:
    """log(pi_prev/pi_gen): [B, S] per token, or [B] per sequence (sum over tokens) for GSPO."""
    log_weights = inputs.prev - inputs.gen
    return log_weights.sum(dim=-1) if sequence_level else log_weights


def _finite_exp(log_values: torch.Tensor) -> torch.Tensor:
    # An overflowing (or NaN) weight drops its token instead of poisoning the whole batch.
    return torch.nan_to_num(torch.exp(log_values), nan=0.0, posinf=0.0, neginf=0.0)


def _log_bounds(low: float | None, high: float | None) -> tuple[float, float]:
    log_low = -math.inf if not low else math.log(low)
    return log_low, (math.inf if high is None else math.log(high))


# (log_weights [B,S] or [B], per-sequence log geometric-mean ratio [B], low, high)
#   -> (weights, out_of_bounds). Truncation is done in log space so that it cannot overflow.
TruncationFn = Callable[[torch.Tensor, torch.Tensor, float | None, float | None], tuple[torch.Tensor, torch.Tensor]]


def no_truncation(
    log_w: torch.Tensor, seq_log_geo: torch.Tensor, low: float | None, high: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain weights."""
    return _finite_exp(log_w), torch.zeros_like(log_w, dtype=torch.bool)


def tis_truncation(
    log_w: torch.Tensor, seq_log_geo: torch.Tensor, low: float | None, high: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated IS: clamp each weight to [low (default 0), high]."""
    log_low, log_high = _log_bounds(low, high)
    return _finite_exp(log_w.clamp(log_low, log_high)), (log_w < log_low) | (log_w > log_high)


def icepop_truncation(
    log_w: torch.Tensor, seq_log_geo: torch.Tensor, low: float | None, high: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """IcePop: weights outside [low, high] become 0 (the token is masked, not clamped)."""
    log_low, log_high = _log_bounds(low, high)
    inside = (log_w >= log_low) & (log_w <= log_high)
    return torch.where(inside, _finite_exp(log_w), 0.0), ~inside


def seq_mask_tis_truncation(
    log_w: torch.Tensor, seq_log_geo: torch.Tensor, low: float | None, high: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero every weight of a sequence whose geometric-mean ratio is outside [low, high].

    ``out_of_bounds`` is per sequence ([B]).
    """
    log_low, log_high = _log_bounds(low, high)
    keep = (seq_log_geo >= log_low) & (seq_log_geo <= log_high)
    keep_like_w = keep if log_w.dim() == 1 else keep[:, None]
    return _finite_exp(log_w) * keep_like_w, ~keep


#: ``loss_fn.truncated_importance_sampling_type`` names (null = :func:`no_truncation`).
TRUNCATIONS: Registry[TruncationFn] = Registry("importance-weight truncation", "loss_fn.truncated_importance_sampling_type")
TRUNCATIONS.add("tis", tis_truncation)
TRUNCATIONS.add("icepop", icepop_truncation)
TRUNCATIONS.add("seq-mask-tis", seq_mask_tis_truncation)


class ImportanceWeights(NamedTuple):
    """Raw and truncated pi_prev/pi_gen weights ([B, S] or [B]) and the out-of-bounds flags (the raw ones for the
    metrics: held at ``exp(hold_limit)``)."""

    raw: torch.Tensor
    truncated: torch.Tensor
    out_of_bounds: torch.Tensor


def importance_weights(inputs: LossInputs, cfg: ClippedPGLossConfig, truncate: TruncationFn | None = None) -> ImportanceWeights:
    """Detached pi_prev/pi_gen weights, truncated as configured (``truncate``: the configured truncation, looked up
    already; else here)."""
    log_w = importance_log_weights(inputs, cfg.sequence_level_importance_ratios).detach()
    seq_log_geo = masked_mean(inputs.prev - inputs.gen, inputs.mask, dim=-1)
    truncate = truncate or configured_truncation(cfg)
    truncated, out_of_bounds = truncate(
        log_w,
        seq_log_geo,
        cfg.truncated_importance_sampling_ratio_min,
        cfg.truncated_importance_sampling_ratio,
    )
    # The raw weights, for the metric only: an overflowing one (the loss drops it: _finite_exp) read as 0, a healthy
    # mean; held at exp(hold_limit) it reads as huge, and a mean over the batch's tokens stays finite.
    raw = torch.exp(log_w.clamp(max=hold_limit(inputs.mask))).nan_to_num(nan=0.0)
    return ImportanceWeights(raw, truncated, out_of_bounds)


# --------------------------------------------------------------------------------------------
# 4. Trust regions
# --------------------------------------------------------------------------------------------

TrustRegionFn = Callable[[LossInputs, float, float], torch.Tensor]


def dppo_binary_tv_keep_mask(inputs: LossInputs, low: float, high: float) -> torch.Tensor:
    """DPPO binary-TV trust region around pi_gen: which valid tokens are kept.

    The binary total variation between pi_curr and pi_gen on the sampled token is
    ``|pi_curr(x) - pi_gen(x)|``. A token is dropped only when it already moved past the band in
    the direction its advantage pushes: ``A > 0`` and ``pi_curr - pi_gen > high``, or ``A < 0`` and
    ``pi_curr - pi_gen < -low``. Moves against the advantage are always kept (they are corrected).
    """
    prob_diff = (torch.exp(inputs.curr) - torch.exp(inputs.gen)).detach()
    advantages = inputs.advantages
    dropped = ((advantages > 0) & (prob_diff > high)) | ((advantages < 0) & (prob_diff < -low))
    return inputs.valid & ~dropped


#: ``loss_fn.trust_region_type`` names; a user trust region returns the [B, S] bool kept mask.
TRUST_REGIONS: Registry[TrustRegionFn] = Registry("trust region", "loss_fn.trust_region_type")
TRUST_REGIONS.add("dppo_binary_tv", dppo_binary_tv_keep_mask)


def mismatch_penalty_per_token(inputs: LossInputs) -> torch.Tensor:
    """``(log pi_curr - log pi_gen)^2``, the quantity ``kl_tau`` weights (Kimi-K2.5 style)."""
    return (inputs.curr - inputs.gen) ** 2


# --------------------------------------------------------------------------------------------
# 5. Reference KL
# --------------------------------------------------------------------------------------------


def registered_here(registry: Registry, name: str | None) -> Any:
    """A plug-in registered under ``name``, looked up in the process that builds the loss (the driver) so that it
    travels with the pickled loss to the policy workers: a name the user registered in their own process
    (``TRUST_REGIONS.add(...)``) is unknown to a worker's registry. None for no name, or an import path
    (``'module:function'``, ``'file.py:function'``), which each process imports itself (a file's module exists only in
    the process that imported it: pickled, the function named a module no worker had)."""
    return None if name is None or ":" in name else registry.get(name)


def configured_truncation(cfg: ClippedPGLossConfig) -> TruncationFn:
    """``loss_fn.truncated_importance_sampling_type``'s function (none: no truncation)."""
    tis_type = cfg.truncated_importance_sampling_type
    return no_truncation if tis_type is None else TRUNCATIONS.get(tis_type)


def reference_kl_per_token(
    inputs: LossInputs, cfg: ClippedPGLossConfig, estimator: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """Per-token estimate of KL(pi_curr || pi_ref), importance-weighted, with gradient.

    The weight is ``pi_curr/pi_gen`` with ``use_on_policy_kl_approximation`` (the tokens come from
    pi_gen), else ``exp(c - stopgrad(c)) = 1``; for k1 and k3 (unbiased) it carries the score-function gradient, so the
    gradient estimates the gradient of each position's conditional KL(pi_curr || pi_ref), prefix held fixed (GRPO's
    per-token convention: the sequence KL's gradient for one-token responses; docs/guides/grpo.md). k2 is biased: with that term its gradient would be
    grad E[k2]; its plain gradient ``(c - ref) grad c`` is the reverse KL's, so its weight is detached
    (:data:`~nemo_like.algorithms.kl.PATHWISE_KL_ESTIMATORS`). Where the input clamp is active the weight
    is detached, so a clamped token gives no KL gradient at all; the output clamp is applied
    after weighting.
    """
    if inputs.ref is None:
        raise ValueError("reference_kl_per_token needs reference_policy_logprobs")
    log_ratio = inputs.ref - inputs.curr
    input_clamped = torch.zeros_like(inputs.valid)
    if cfg.kl_input_clamp_value is not None:
        bound = cfg.kl_input_clamp_value
        input_clamped = log_ratio.detach().abs() > bound
        log_ratio = log_ratio.clamp(-bound, bound)
    # Past exp's range (no input clamp) k3's value is inf and its derivative too: the output clamp's zero gradient times
    # inf made a NaN that skipped the whole step. Such a token is treated as clamped: its value detached, no gradient.
    overflow = log_ratio.detach() > exp_limit(log_ratio.dtype)
    log_ratio = torch.where(overflow, log_ratio.detach(), log_ratio)  # no host sync on a GPU: always
    input_clamped = input_clamped | overflow
    # Estimators of KL(pi || pi_ref) from log_ratio = log pi_ref - log pi on tokens x ~ pi.
    kl = (estimator or KL_ESTIMATORS.get(cfg.reference_policy_kl_type))(log_ratio)
    if not isinstance(kl, torch.Tensor) or kl.shape != log_ratio.shape:  # a scalar had been broadcast: a wrong penalty
        expected = f"a per-token tensor of the log-ratio's shape {dims(log_ratio.shape)}"
        raise plugin_output_error(f"loss_fn.reference_policy_kl_type={cfg.reference_policy_kl_type!r}", kl, expected)
    baseline = inputs.gen if cfg.use_on_policy_kl_approximation else inputs.curr.detach()
    # A weight past exp's range (a generation logprob of -inf or below ~-88 in float32) or NaN is 0, and so is its
    # gradient: zeroing exp's value after it (nan_to_num) left exp's infinite derivative, a NaN that skipped the step.
    log_weight = inputs.curr - baseline
    finite = torch.isfinite(log_weight.detach()) & (log_weight.detach() < exp_limit(log_weight.dtype))
    weights = torch.where(finite, torch.exp(torch.where(finite, log_weight, 0.0)), 0.0)
    pathwise = cfg.reference_policy_kl_type in PATHWISE_KL_ESTIMATORS
    kl = kl * (weights.detach() if pathwise else torch.where(input_clamped, weights.detach(), weights))
    if cfg.kl_output_clamp_value is not None:
        kl = kl.clamp(-cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
    return kl


def kl_clamp_active(reference_kl: torch.Tensor, inputs: LossInputs, cfg: ClippedPGLossConfig) -> torch.Tensor:
    """``[B, S]`` bool: tokens where a KL clamp is active (``kl_input_clamp_value`` on ``log pi_ref - log pi_curr``, or
    ``kl_output_clamp_value`` on the weighted estimate ``reference_kl``): their value is biased low and their gradient
    gone (``kl_clamped_fraction``)."""
    active = torch.zeros_like(inputs.valid)
    if cfg.kl_input_clamp_value is not None:
        active = (inputs.ref - inputs.curr).detach().abs() > cfg.kl_input_clamp_value
    if cfg.kl_output_clamp_value is not None:
        active = active | (reference_kl.detach().abs() >= cfg.kl_output_clamp_value)
    return active


# --------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------


def _masked_extreme(values: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    identity = math.inf if reduction == "min" else -math.inf
    filled = torch.where(valid, values.detach(), identity)
    if filled.numel() == 0:
        return values.new_tensor(identity)
    return filled.amin() if reduction == "min" else filled.amax()


def _approx_entropy(inputs: LossInputs) -> torch.Tensor:
    """Entropy of pi_curr estimated on pi_gen samples: E_gen[(pi_curr/pi_gen) (-log pi_curr)]."""
    curr = inputs.curr.detach()
    return _token_mean(-_finite_exp(curr - inputs.gen) * curr, inputs)


def _mean_over(values: torch.Tensor, inputs: LossInputs, sequence_level: bool) -> torch.Tensor:
    """Token mean of [B, S] values, or sequence mean of [B] values (global normalisation)."""
    if sequence_level:
        return masked_mean(values, inputs.sample_mask, global_normalization_factor=inputs.global_valid_seqs)
    return _token_mean(values, inputs)


class ClippedPGLossFn:
    """Clipped policy-gradient loss; see the module docstring and ``docs/guides/grpo.md``.

    Call: ``loss, metrics = loss_fn(curr_logprobs, data, global_valid_seqs, global_valid_toks)``
    once per microbatch. ``data`` holds ``generation_logprobs``, ``advantages``, ``token_mask``,
    ``sample_mask`` and optionally ``prev_logprobs`` and ``reference_policy_logprobs`` (required
    when ``reference_policy_kl_penalty > 0``). Summing the losses of all microbatches gives the
    full-batch loss; ``metrics`` are fragments to combine with :func:`combine_metric_fragments`
    and :meth:`metric_reduction`.
    """

    def __init__(self, cfg: ClippedPGLossConfig | Mapping[str, Any] | None = None) -> None:
        if cfg is None:
            cfg = ClippedPGLossConfig()
        elif not isinstance(cfg, ClippedPGLossConfig):
            cfg = ClippedPGLossConfig.model_validate(dict(cfg))
        self.cfg = cfg
        self.reference_policy_kl_penalty = cfg.reference_policy_kl_penalty
        self.surrogate_name = select_surrogate(cfg)
        self._surrogate = registered_here(SURROGATES, self.surrogate_name)
        self._truncate = registered_here(TRUNCATIONS, cfg.truncated_importance_sampling_type)
        self._kl_estimator = registered_here(KL_ESTIMATORS, cfg.reference_policy_kl_type)
        self._trust_region = registered_here(TRUST_REGIONS, cfg.trust_region_type)
        self.aggregation = cfg.aggregation
        self._sequence_level_metrics: frozenset[str] = frozenset()  # set by each call (_importance_metrics)

    @staticmethod
    def metric_reduction(name: str) -> Reduction:
        """How the fragments of metric ``name`` combine: "sum", "min" or "max".

        ``*_min`` keys combine with min, ``*_max`` keys with max, every other fragment with sum.
        Derived metrics (``rollout_corr/is_eff_sample_size``, ``trust_region/kl_penalty``) are not
        fragments and raise ValueError; :func:`combine_metric_fragments` recomputes them.
        """
        return default_metric_reduction(name)

    def combine_metrics(self, fragments: list[dict[str, float]]) -> dict[str, float]:
        """The batch's metrics from the fragments of its micro-batches (and ranks), derived ones included."""
        return combine_metric_fragments(fragments, self.metric_reduction)

    def metric_normaliser(self, name: str) -> str | None:
        """What metric ``name``'s fragments are normalised by: "tokens" or "sequences" (the global count of valid ones),
        or None for a loss term (``loss``, ``actor_loss``, ``kl_penalty``, ``distillation/*``: each step's own
        objective). The importance-sampling means are over sequences where this loss's last call computed them per
        sequence (GSPO's ratios, a per-sequence truncation)."""
        if name in ("loss", "actor_loss", "kl_penalty") or name.startswith("distillation/"):
            return None
        if name in SEQUENCE_MEAN_METRICS or name in self._sequence_level_metrics:
            return "sequences"
        return "tokens"

    def combine_steps(self, per_step: list[dict[str, float]], step_counts: list[dict[str, float]] | None = None) -> dict[str, float]:
        """A train call's metrics from its optimizer steps' (:func:`~nemo_like.algorithms.metrics.combine_optimizer_steps`);
        ``step_counts``: each step's global ``tokens`` and ``sequences`` (valid ones), which weigh its means."""
        return combine_optimizer_steps(per_step, self.metric_reduction, self.metric_normaliser, step_counts)

    def __call__(
        self,
        curr_logprobs: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one microbatch (normalised by the global counts) and its metric fragments."""
        cfg = self.cfg
        beta = cfg.reference_policy_kl_penalty
        if beta > 0 and data.get("reference_policy_logprobs") is None:
            raise ValueError(
                f"loss_fn.reference_policy_kl_penalty={beta} requires "
                "data['reference_policy_logprobs'] (compute reference logprobs, or set the penalty to 0)"
            )
        inputs = LossInputs.from_data(curr_logprobs, data, global_valid_seqs, global_valid_toks, cfg.force_on_policy_ratio)

        surrogate_fn = self._surrogate or SURROGATES.get(self.surrogate_name)
        surrogate = surrogate_fn(ppo_log_ratio(inputs, cfg.sequence_level_importance_ratios), inputs, cfg)
        if not isinstance(surrogate, Surrogate) or surrogate.loss.shape != inputs.curr.shape:  # a user's, by import path
            raise plugin_output_error(f"loss_fn.surrogate={self.surrogate_name!r}", surrogate, "a Surrogate(loss, ratio, "
                                      f"ratio_clamped, clipped) of per-token {dims(inputs.curr.shape)} tensors")  # fmt: skip
        weights = importance_weights(inputs, cfg, self._truncate)
        per_token = surrogate.loss
        if cfg.use_importance_sampling_correction:
            per_token = per_token * _as_per_token(weights.truncated)
        keep = self._keep_mask(inputs)
        per_token = torch.where(keep, per_token, 0.0)
        aggregate = functools.partial(
            reduce_per_token,
            inputs=inputs,
            aggregation=self.aggregation,
            normalizer=cfg.loss_aggregation_normalizer,
        )
        actor_loss = aggregate(per_token)

        mismatch = torch.where(keep, mismatch_penalty_per_token(inputs), 0.0)
        loss = actor_loss
        if cfg.kl_tau > 0:
            loss = loss + cfg.kl_tau * aggregate(mismatch)
        kl_penalty = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
        kl_clamped = torch.zeros_like(per_token)
        if inputs.ref is not None:
            reference_kl = reference_kl_per_token(inputs, cfg, self._kl_estimator)
            kl_penalty = aggregate(reference_kl)
            kl_clamped = kl_clamp_active(reference_kl, inputs, cfg).to(per_token.dtype)
            if beta > 0:
                loss = loss + beta * kl_penalty

        fragments = {
            "loss": loss,
            "actor_loss": actor_loss,
            "kl_penalty": kl_penalty,
            "kl_clamped_fraction": _token_mean(kl_clamped, inputs),
            **self._ratio_metrics(inputs, surrogate),
            **self._importance_metrics(inputs, weights),
            **self._trust_region_metrics(inputs, keep, mismatch),
            "approx_entropy": _approx_entropy(inputs),
            "num_valid_tokens": inputs.mask.sum(),
            "num_valid_seqs": inputs.sample_mask.sum(),
            **divergence_metric_fragments(
                inputs.prev,
                inputs.gen,
                inputs.mask,
                inputs.sample_mask,
                inputs.global_valid_toks,
                inputs.global_valid_seqs,
            ),
        }
        names = list(fragments)
        values = torch.stack([fragments[n].detach().double().reshape(()) for n in names]).tolist()
        return loss, dict(zip(names, values))

    def _keep_mask(self, inputs: LossInputs) -> torch.Tensor:
        if self.cfg.trust_region_type is None:
            return inputs.valid
        trust_region = self._trust_region or TRUST_REGIONS.get(self.cfg.trust_region_type)
        keep = trust_region(inputs, self.cfg.trust_region_low, self.cfg.trust_region_high)
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != inputs.valid.shape:
            expected = f"a bool keep mask of shape {dims(inputs.valid.shape)}"
            raise plugin_output_error(f"loss_fn.trust_region_type={self.cfg.trust_region_type!r}", keep, expected)
        return keep

    @staticmethod
    def _ratio_metrics(inputs: LossInputs, surrogate: Surrogate) -> dict[str, torch.Tensor]:
        ratio, ratio_clamped = surrogate.ratio.detach(), surrogate.ratio_clamped.detach()
        return {
            "probs_ratio": _token_mean(ratio, inputs),
            "probs_ratio_clamped": _token_mean(ratio_clamped, inputs),
            "probs_ratio_min": _masked_extreme(ratio, inputs.valid, "min"),
            "probs_ratio_max": _masked_extreme(ratio, inputs.valid, "max"),
            "probs_ratio_clamped_min": _masked_extreme(ratio_clamped, inputs.valid, "min"),
            "probs_ratio_clamped_max": _masked_extreme(ratio_clamped, inputs.valid, "max"),
            "clip_fraction": _token_mean(surrogate.clipped.to(ratio.dtype), inputs),
        }

    def _importance_metrics(self, inputs: LossInputs, weights: ImportanceWeights) -> dict[str, torch.Tensor]:
        sequence_level = weights.raw.dim() == 1
        oob = weights.out_of_bounds.to(weights.raw.dtype)
        ratios = ("sampling_importance_ratio_untruncated", "sampling_importance_ratio") if sequence_level else ()
        self._sequence_level_metrics = frozenset((*ratios, *(("is_oob_ratio",) if oob.dim() == 1 else ())))
        return {
            "sampling_importance_ratio_untruncated": _mean_over(weights.raw, inputs, sequence_level),
            "sampling_importance_ratio": _mean_over(weights.truncated, inputs, sequence_level),
            "is_oob_ratio": _mean_over(oob, inputs, oob.dim() == 1),
        }

    @staticmethod
    def _trust_region_metrics(inputs: LossInputs, keep: torch.Tensor, mismatch: torch.Tensor) -> dict[str, torch.Tensor]:
        kept = keep.to(inputs.mask.dtype)
        return {
            "trust_region/kept_fraction": _token_mean(kept, inputs),
            "trust_region/masked_fraction": _token_mean(1.0 - kept, inputs),
            "trust_region/kl_penalty_per_valid_token": _token_mean(mismatch.detach(), inputs),
        }
