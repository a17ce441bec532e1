"""Divergence estimators between the generation and the training policy, and metric combining.

Every per-token estimator takes ``log_ratio = log pi_train(x) - log pi_gen(x)`` (``r = exp(log_ratio)``)
for a token ``x`` **sampled from pi_gen** (the inference engine) and returns a value whose
expectation under pi_gen is the stated divergence. "Unbiased" means exactly that; any clamp adds
bias, stated where used. ``docs/guides/grpo.md`` derives each one and works an example.

Metrics are returned per microbatch as *fragments*: each fragment is normalised by the global
token or sequence count, so combining the fragments of all microbatches and data-parallel ranks
(sum, min or max, see :func:`default_metric_reduction`) gives the full-batch value. Metrics that
are not sums of per-token or per-sequence terms (the effective sample size, a mean over kept
tokens) are *derived*: :func:`combine_metric_fragments` computes them from combined fragments.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Literal

import torch

from nemo_like.algorithms.kl import kl_k1, kl_k3
from nemo_like.algorithms.utils import masked_mean

Reduction = Literal["sum", "min", "max"]

# verl's bound on log ratios before exponentiating in the rollout-correction metrics.
LOG_RATIO_SAFETY_BOUND = 20.0

_LOG2 = math.log(2.0)


# --------------------------------------------------------------------------------------------
# Per-token estimators (samples from pi_gen, log_ratio = log pi_train - log pi_gen)
# --------------------------------------------------------------------------------------------


def kl_gen_train_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """k1 estimate of KL(pi_gen || pi_train): ``-log r``.

    Unbiased; a single value can be negative, and the variance is high when the policies agree.
    """
    return kl_k1(log_ratio)


def kl_gen_train_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi_gen || pi_train): ``r - 1 - log r``.

    Unbiased because ``E_gen[r] = 1`` (when pi_train puts no mass outside pi_gen's support), and
    every value is >= 0 with lower variance than k1 near r = 1.
    """
    return kl_k3(log_ratio)


def kl_train_gen(log_ratio: torch.Tensor) -> torch.Tensor:
    """Importance-weighted estimate of KL(pi_train || pi_gen): ``r log r - r + 1``.

    ``E_gen[r log r] = E_train[log r] = KL(pi_train || pi_gen)`` and ``E_gen[r - 1] = 0``, so the
    estimate is unbiased; the ``-r + 1`` control variate makes every value >= 0 (the function is
    convex with its minimum 0 at r = 1). Plugging the reversed ratio into k3 instead
    (``1/r - 1 + log r``) estimates chi^2(pi_gen || pi_train) - KL(pi_gen || pi_train) under
    pi_gen samples, not this KL.
    """
    return torch.exp(log_ratio) * log_ratio - torch.expm1(log_ratio)


def js_divergence(log_ratio: torch.Tensor) -> torch.Tensor:
    """Estimate of JS(pi_gen, pi_train) with M = (pi_gen + pi_train)/2.

    ``JS = 0.5 KL(gen || M) + 0.5 KL(train || M) = E_gen[0.5 log(2/(1+r)) + 0.5 r log(2r/(1+r))]``
    (the second term importance-weighted by r). Unbiased; the summand is the convex JS generator,
    which is 0 with zero slope at r = 1, so every value is >= 0. Its expectation is at most log 2,
    although a single value grows like ``0.5 r log 2`` for large r.
    """
    softplus = torch.nn.functional.softplus(log_ratio)  # log(1 + r)
    r = torch.exp(log_ratio)
    return 0.5 * (_LOG2 - softplus) + 0.5 * r * (_LOG2 + log_ratio - softplus)


def chi2_train_gen(log_ratio: torch.Tensor) -> torch.Tensor:
    """Estimate of chi^2(pi_train || pi_gen) = Var_gen[r]: ``r^2 - 1``.

    Unbiased (``E_gen[r^2] = sum pi_train^2/pi_gen``); single values lie in [-1, inf).
    """
    return torch.expm1(2.0 * log_ratio)


def mult_prob_error(log_ratio: torch.Tensor) -> torch.Tensor:
    """Multiplicative probability error ``exp(|log r|) = max(r, 1/r) >= 1`` (not a divergence)."""
    return torch.exp(log_ratio.abs())


# --------------------------------------------------------------------------------------------
# Batch fragments
# --------------------------------------------------------------------------------------------


def divergence_metric_fragments(
    train_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    global_valid_toks: torch.Tensor | float,
    global_valid_seqs: torch.Tensor | float,
) -> dict[str, torch.Tensor]:
    """Generation-vs-training divergence metrics of one microbatch, as summable fragments.

    Computed in float64 without gradient. Token metrics are masked sums divided by
    ``global_valid_toks``; per-sequence metrics (``*_ppl``, ``chi2_seq*``) are sums over counted
    sequences divided by ``global_valid_seqs``.

    Args:
        train_logprobs: [B, S] log pi_train (prev logprobs, or current ones when on-policy).
        gen_logprobs: [B, S] log pi_gen from the generation engine.
        token_mask: [B, S] 1 on counted response tokens.
        sample_mask: [B] 1 on counted samples.
        global_valid_toks: valid tokens in the whole global batch.
        global_valid_seqs: valid sequences in the whole global batch.

    Returns:
        Metric name -> 0-dim float64 tensor (see the module docstring for the combine rule).
    """
    train_logprobs = train_logprobs.detach().double()
    gen_logprobs = gen_logprobs.detach().double()
    seq_mask = sample_mask.double()
    mask = token_mask.double() * seq_mask[:, None]
    valid = mask > 0
    log_ratio = torch.where(valid, train_logprobs - gen_logprobs, 0.0)
    safe_log_ratio = log_ratio.clamp(-LOG_RATIO_SAFETY_BOUND, LOG_RATIO_SAFETY_BOUND)

    def token_mean(values: torch.Tensor) -> torch.Tensor:
        return masked_mean(values, mask, global_normalization_factor=global_valid_toks)

    def seq_mean(values: torch.Tensor) -> torch.Tensor:
        return masked_mean(values, seq_mask, global_normalization_factor=global_valid_seqs)

    def per_seq_mean(values: torch.Tensor) -> torch.Tensor:
        return masked_mean(torch.where(valid, values, 0.0), mask, dim=-1)

    seq_log_ratio_sum = torch.where(valid, log_ratio, 0.0).sum(dim=-1).clamp(-LOG_RATIO_SAFETY_BOUND, LOG_RATIO_SAFETY_BOUND)
    seq_log_ratio_mean = per_seq_mean(log_ratio).clamp(-LOG_RATIO_SAFETY_BOUND, LOG_RATIO_SAFETY_BOUND)
    return {
        "gen_kl": token_mean(kl_gen_train_k3(log_ratio)),
        "policy_kl": token_mean(kl_train_gen(log_ratio)),
        "js_divergence": token_mean(js_divergence(log_ratio)),
        "token_mult_prob_error": token_mean(mult_prob_error(log_ratio)),
        "rollout_corr/kl": token_mean(kl_gen_train_k1(log_ratio)),
        "rollout_corr/k3_kl": token_mean(kl_gen_train_k3(safe_log_ratio)),
        "rollout_corr/chi2_token": token_mean(chi2_train_gen(safe_log_ratio)),
        "rollout_corr/chi2_seq": seq_mean(torch.expm1(2.0 * seq_log_ratio_sum)),
        "rollout_corr/chi2_seq_geomean": seq_mean(torch.expm1(2.0 * seq_log_ratio_mean)),
        "rollout_corr/training_ppl": seq_mean(torch.exp(-per_seq_mean(train_logprobs))),
        "rollout_corr/rollout_ppl": seq_mean(torch.exp(-per_seq_mean(gen_logprobs))),
        "rollout_corr/is_weight_mean": token_mean(torch.exp(safe_log_ratio)),
        "rollout_corr/is_weight_sq_mean": token_mean(torch.exp(2.0 * safe_log_ratio)),
    }


# --------------------------------------------------------------------------------------------
# Combining fragments over microbatches and data-parallel ranks
# --------------------------------------------------------------------------------------------


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


#: name -> (fragment names it is computed from, function of the combined fragments).
DERIVED_METRICS: Mapping[str, tuple[tuple[str, ...], Callable[..., float]]] = {
    # Kish effective sample size of the token IS weights r, as a fraction of the tokens:
    # (sum r)^2 / (N sum r^2) = mean(r)^2 / mean(r^2), in (0, 1].
    "rollout_corr/is_eff_sample_size": (
        ("rollout_corr/is_weight_mean", "rollout_corr/is_weight_sq_mean"),
        lambda mean, sq_mean: _ratio(mean * mean, sq_mean),
    ),
    # Mean of (log pi_curr - log pi_gen)^2 over kept tokens only.
    "trust_region/kl_penalty": (
        ("trust_region/kl_penalty_per_valid_token", "trust_region/kept_fraction"),
        _ratio,
    ),
}


def default_metric_reduction(name: str) -> Reduction:
    """How fragments of metric ``name`` combine: ``*_min`` -> min, ``*_max`` -> max, else sum.

    Raises:
        ValueError: for derived metrics, which are recomputed rather than reduced.
    """
    if name in DERIVED_METRICS:
        raise ValueError(f"{name!r} is derived from other fragments; use combine_metric_fragments")
    if name.endswith("_min"):
        return "min"
    if name.endswith("_max"):
        return "max"
    return "sum"


def _reduce(values: list[float], reduction: str) -> float:
    if reduction == "sum":
        return math.fsum(values)
    # A min/max fragment of a micro-batch without valid tokens is +inf/-inf, the identity, which min/max pass over
    # (and keep when nothing else is there: :func:`empty_extremes_as_nan` reports that at the end). A NaN is a
    # non-finite micro-batch, whose extreme is unknown: it stays NaN (dropped, the logged max came from the finite
    # micro-batches while the loss was NaN).
    if any(math.isnan(v) for v in values):
        return math.nan
    return min(values) if reduction == "min" else max(values)


def empty_extremes_as_nan(metrics: dict[str, float]) -> dict[str, float]:
    """The combined metrics as logged: a ``*_min`` still +inf or a ``*_max`` still -inf had no valid token anywhere
    (the identity of its reduction), reported as NaN. Apply once, to the final combine (combining keeps the identity,
    so that it stays associative)."""
    empty = {"_min": math.inf, "_max": -math.inf}
    return {k: math.nan if isinstance(v, float) and k[-4:] in empty and v == empty[k[-4:]] else v for k, v in metrics.items()}


#: Fragment keys that count things: summed over a train call's optimizer steps (every other summed fragment is a mean
#: or a fraction over its own step's global batch).
COUNT_METRICS = frozenset({"num_valid_tokens", "num_valid_seqs"})

#: :func:`divergence_metric_fragments` means over sequences (normalised by the global sequence count); the others of
#: that function are means over tokens.
SEQUENCE_MEAN_METRICS = frozenset(
    {"rollout_corr/chi2_seq", "rollout_corr/chi2_seq_geomean", "rollout_corr/training_ppl", "rollout_corr/rollout_ppl"}
)

#: What a mean fragment is normalised by: "tokens" or "sequences" (the step's global count of valid ones; a train call
#: weighs its steps by them), or None for a loss term (each step's own objective: the steps' values are averaged).
Normaliser = Callable[[str], "str | None"]


def combine_optimizer_steps(
    per_step: list[dict[str, float]],
    reduction_for: Callable[[str], str],
    normaliser_for: Normaliser | None = None,
    step_counts: list[dict[str, float]] | None = None,
) -> dict[str, float]:
    """One train call's metrics from its optimizer steps' metrics (each combined over its micro-batches): a mean or a
    fraction over the call's tokens (sequences), the steps' values weighed by their steps' global counts of valid
    tokens (sequences) (``normaliser_for(name)``, ``step_counts[s]["tokens" | "sequences"]``); a loss term, or any
    mean without those, the mean of the steps' values; a count (:data:`COUNT_METRICS`) their sum; a min or max over
    them all; derived metrics recomputed from the combined inputs. Both are linear with weights every rank shares, so
    per-rank results of this still add up over data-parallel ranks as one step's fragments do."""
    if len(per_step) == 1:
        return dict(per_step[0])
    names = dict.fromkeys(k for metrics in per_step for k in metrics if k not in DERIVED_METRICS)
    combined: dict[str, float] = {}
    for name in names:
        values = [float(m[name]) for m in per_step if name in m]
        reduction = reduction_for(name)
        kind = normaliser_for(name) if normaliser_for is not None and step_counts is not None else None
        if reduction != "sum":
            combined[name] = _reduce(values, reduction)
        elif name in COUNT_METRICS:
            combined[name] = math.fsum(values)
        elif kind is not None:
            # Each step's value is (its sum) / (its global count): weighed by the counts, the call's sum over the call's
            # count, i.e. a mean over every token (sequence) of the call, not over steps (a short step weighed as a long
            # one). A step this rank had no row in adds 0, and still counts.
            weights = [counts[kind] for counts in step_counts]
            total = math.fsum(weights)
            combined[name] = math.fsum(float(m.get(name, 0.0)) * w for m, w in zip(per_step, weights)) / total if total else 0.0
        else:
            # Over every step, a step this rank had no row in included (its share of that step's mean is 0): each
            # step's fragments are normalised by the step's global counts, so the ranks' results still add up.
            combined[name] = math.fsum(values) / len(per_step)
    for name, (inputs, derive) in DERIVED_METRICS.items():
        if all(i in combined for i in inputs):
            combined[name] = float(derive(*(combined[i] for i in inputs)))
    return combined


def combine_metric_fragments(
    fragments: list[dict[str, float]],
    reduction_for: Callable[[str], str],
) -> dict[str, float]:
    """Combine per-microbatch (and per-rank) metric fragments into full-batch metrics.

    Each non-derived key is reduced with ``reduction_for(key)`` ("sum", "min" or "max"); a min or
    max with no valid token anywhere keeps its identity (+inf / -inf; :func:`empty_extremes_as_nan` reports it as NaN),
    and a NaN fragment (a non-finite micro-batch) makes it NaN. Derived metrics (:data:`DERIVED_METRICS`) present in
    the inputs are dropped and recomputed from the combined fragments, so combining is
    associative: combining per-rank results again gives the same values as one flat combine.

    Args:
        fragments: metric dicts, e.g. one per microbatch and data-parallel rank.
        reduction_for: maps a metric name to its reduction, e.g. ``ClippedPGLossFn.metric_reduction``.

    Returns:
        The combined metrics, derived ones included when their fragments are present.
    """
    names: dict[str, None] = {}
    for fragment in fragments:
        names.update(dict.fromkeys(k for k in fragment if k not in DERIVED_METRICS))
    combined: dict[str, float] = {}
    for name in names:
        reduction = reduction_for(name)
        if reduction not in ("sum", "min", "max"):
            raise ValueError(f"unknown reduction {reduction!r} for metric {name!r}")
        combined[name] = _reduce([float(f[name]) for f in fragments if name in f], reduction)
    for name, (inputs, derive) in DERIVED_METRICS.items():
        if all(i in combined for i in inputs):
            combined[name] = float(derive(*(combined[i] for i in inputs)))
    return combined
