"""Driver-side masks that remove off-policy samples from the loss before the step's counts are made.

Both run in ``train_on_rollout`` after the prev-logprob pass and before ``policy.train`` builds
``global_valid_toks`` / ``global_valid_seqs`` from ``token_mask * sample_mask``; so, unlike a
truncated-IS weight of 0 (icepop, seq-mask-tis), a rejected token or sample also leaves the counts
the loss is normalised by.

* :func:`mask_high_mismatch_sequences` - ``grpo.seq_logprob_error_threshold`` (NeMo-RL's key, our
  statistic ``exp(mean_t |log pi_prev - log pi_gen|)``, see ``docs/guides/grpo.md``).
* :func:`apply_rollout_rejection` - ``grpo.rollout_rejection``: token- or sequence-level bounds on
  the ratio ``pi_prev/pi_gen`` or on a per-sequence k1/k2/k3 mismatch statistic, with diagnostics.

Tensors are ``[B, S]`` aligned with ``input_ids``; masks are 1 on counted response tokens/samples.
"""

from __future__ import annotations

import math

import torch

from nemo_like.algorithms.kl import KL_ESTIMATORS
from nemo_like.algorithms.metrics import LOG_RATIO_SAFETY_BOUND
from nemo_like.config.rejection import RolloutRejectionConfig
from nemo_like.config.schema import MasterConfig
from nemo_like.environments.interface import CORRECT_REWARD

Batch = dict[str, torch.Tensor]


def _valid_tokens(batch: Batch) -> torch.Tensor:
    return (batch["token_mask"] > 0) & (batch["sample_mask"] > 0)[:, None]


def _log_ratio(batch: Batch, valid: torch.Tensor) -> torch.Tensor:
    """``log pi_prev - log pi_gen`` in float64, 0 (never NaN/inf) outside ``valid``."""
    diff = batch["prev_logprobs"].double() - batch["generation_logprobs"].double()
    return torch.where(valid, diff, 0.0)


def _summary(values: torch.Tensor) -> dict[str, float]:
    """mean/min/max/std (population) of a 1-D tensor's finite values; all 0.0 when there are none."""
    values = values[values.isfinite()]
    if values.numel() == 0:
        return {"mean": 0.0, "min": 0.0, "max": 0.0, "std": 0.0}
    values = values.double()
    return {
        "mean": values.mean().item(),
        "min": values.min().item(),
        "max": values.max().item(),
        "std": values.std(unbiased=False).item(),
    }


# --------------------------------------------------------------------------------------------
# grpo.seq_logprob_error_threshold
# --------------------------------------------------------------------------------------------


def sequence_logprob_error(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``exp(mean_t |log pi_prev - log pi_gen|)`` over valid tokens, and which samples
    are eligible (counted, with at least one valid token). Ineligible samples get 1.0."""
    valid = _valid_tokens(batch)
    gap = _log_ratio(batch, valid).abs()
    count = valid.sum(-1)
    eligible = count > 0
    error = torch.exp(gap.sum(-1) / count.clamp(min=1))
    return torch.where(eligible, error, 1.0), eligible


def mask_high_mismatch_sequences(threshold: float | None, batch: Batch, rewards: torch.Tensor | None = None) -> dict[str, float]:
    """Zero ``sample_mask`` where the sequence's logprob error exceeds ``threshold``.

    Only eligible samples (counted, with response tokens) are judged or enter the statistics, so
    an empty or all-masked batch reports zeros instead of failing.

    Returns:
        ``seq_logprob_error/`` metrics: ``masked_fraction`` (of eligible samples), ``max`` (over
        eligible samples), ``{mean,min,max}_before`` / ``_after`` masking, ``num_masked`` and
        ``masked_correct_fraction`` (share of the masked samples whose task reward, before any shaping, reaches
        the correct-answer reward; 0 when none: a format reward of 0.1 made a wrong answer count as correct).
        ``{}`` when ``threshold`` is None.
    """
    if threshold is None:
        return {}
    error, eligible = sequence_logprob_error(batch)
    bad = eligible & ~(error <= threshold)  # NaN too: no comparison holds for it, so it had passed every mask
    batch["sample_mask"] = torch.where(bad, torch.zeros_like(batch["sample_mask"]), batch["sample_mask"])
    num_eligible, num_bad = int(eligible.sum()), int(bad.sum())
    correct = 0.0
    if rewards is not None and num_bad:
        correct = (rewards.double()[bad] >= CORRECT_REWARD).double().mean().item()
    before, after = _summary(error[eligible]), _summary(error[eligible & ~bad])
    metrics = {
        "seq_logprob_error/masked_fraction": num_bad / num_eligible if num_eligible else 0.0,
        "seq_logprob_error/num_masked": float(num_bad),
        "seq_logprob_error/masked_correct_fraction": correct,
        "seq_logprob_error/max": before["max"],
    }
    for tag, summary in (("before", before), ("after", after)):
        metrics.update({f"seq_logprob_error/{name}_{tag}": summary[name] for name in ("mean", "min", "max")})
    return metrics


# --------------------------------------------------------------------------------------------
# grpo.rollout_rejection
# --------------------------------------------------------------------------------------------


def _log_bound(value: float | None, ratio: bool, default: float) -> float:
    if value is None:
        return default
    return math.log(value) if ratio else value


def sequence_statistic(log_ratio: torch.Tensor, valid: torch.Tensor, statistic: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence ``(high, low)`` values compared with the upper / lower bound.

    Ratio statistics are returned as log-ratios (bounds are compared in log space, so a long
    sequence's summed log-ratio cannot overflow): ``sum`` / ``mean`` of the token log-ratios
    (high = low), ``max``: high = the largest token log-ratio, low = the smallest (token veto).
    ``k1``/``k2``/``k3``: the mean over tokens of that KL(pi_gen || pi_prev) estimator (high = low).
    Sequences without a valid token get 0 (a ratio of 1, a KL of 0).
    """
    count = valid.sum(-1)
    has_tokens = count > 0
    if statistic == "sum":
        value = log_ratio.sum(-1)
        return value, value
    if statistic == "mean":
        value = log_ratio.sum(-1) / count.clamp(min=1)
        return value, value
    if statistic == "max":
        high = torch.where(valid, log_ratio, -math.inf).amax(-1) if log_ratio.numel() else log_ratio.sum(-1)
        low = torch.where(valid, log_ratio, math.inf).amin(-1) if log_ratio.numel() else log_ratio.sum(-1)
        return torch.where(has_tokens, high, 0.0), torch.where(has_tokens, low, 0.0)
    estimator = KL_ESTIMATORS.get(statistic)
    value = torch.where(valid, estimator(log_ratio), 0.0).sum(-1) / count.clamp(min=1)
    return value, value


def bounded_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """A ratio for the diagnostics from its log, clamped at +-``LOG_RATIO_SAFETY_BOUND`` (e^20): a summed log-ratio over
    thousands of tokens passes 709 and its exp overflows to inf (then the std to nan). The masking compares logs."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_SAFETY_BOUND, LOG_RATIO_SAFETY_BOUND))


def apply_rollout_rejection(cfg: RolloutRejectionConfig, batch: Batch) -> dict[str, float]:
    """Remove out-of-bounds tokens (``level: token``) or samples (``level: sequence``) from
    ``batch['token_mask']`` / ``batch['sample_mask']`` in place; returns diagnostics.

    A sample left with no valid token is also removed from ``sample_mask`` (it would otherwise
    count as a sequence in the sequence-level loss normalisation).

    Diagnostics (``rollout_rejection/``), over the tokens / samples counted before rejection:
    ``token_ratio_{max,min,std}`` of pi_prev/pi_gen, ``token_frac_{above,below}`` the bounds (0
    when the bounds are on a k1/k2/k3 value),
    ``seq_stat_{max,min,std}`` of the per-sequence statistic (the ratio exp(...) for sum/mean/max;
    for level 'token' the geometric-mean ratio), ``seq_frac_{above,below}``,
    ``masked_token_fraction`` and ``masked_seq_fraction``, ``token_frac_nonfinite`` / ``seq_frac_nonfinite`` (a NaN or
    infinite log-ratio or statistic: rejected at the level rejection works on, counted apart from ``*_frac_above`` /
    ``*_frac_below``, left out of the summaries). ``{}`` when rejection is off.
    """
    if not cfg.enabled:
        return {}
    valid = _valid_tokens(batch)
    log_ratio = _log_ratio(batch, valid)
    statistic = cfg.sequence_statistic if cfg.level == "sequence" else "mean"
    ratio_stat = statistic in ("sum", "mean", "max")
    # Token diagnostics compare token ratios with the bounds only when the bounds are ratios.
    tok_low = _log_bound(cfg.lower, True, -math.inf) if ratio_stat else -math.inf
    tok_high = _log_bound(cfg.upper, True, math.inf) if ratio_stat else math.inf
    seq_low = _log_bound(cfg.lower, ratio_stat, -math.inf)
    seq_high = _log_bound(cfg.upper, ratio_stat, math.inf)

    # a NaN log-ratio passed every bound (no comparison holds for it) and an infinite one passes a one-sided bound on
    # its other side (a -inf generation logprob's k1 is -inf: kept under an upper-only KL bound): both rejected, and
    # counted apart from the finite values above and below the bounds
    finite = log_ratio.isfinite()
    tok_nonfinite = valid & ~finite
    tok_above = valid & finite & (log_ratio > tok_high)
    tok_below = valid & finite & (log_ratio < tok_low)
    eligible = valid.any(-1)
    high, low = sequence_statistic(log_ratio, valid, statistic)
    seq_finite = high.isfinite() & low.isfinite()  # k3's expm1(inf) - inf is NaN
    seq_nonfinite = eligible & ~seq_finite
    seq_above = eligible & seq_finite & (high > seq_high)
    seq_below = eligible & seq_finite & (low < seq_low)

    token_mask, sample_mask = batch["token_mask"], batch["sample_mask"]
    if cfg.level == "token":
        rejected = tok_above | tok_below | tok_nonfinite
        token_mask = torch.where(rejected, torch.zeros_like(token_mask), token_mask)
        kept_any = ((token_mask > 0) & valid).any(-1)
        sample_mask = torch.where(eligible & ~kept_any, torch.zeros_like(sample_mask), sample_mask)
    else:
        sample_mask = torch.where(seq_above | seq_below | seq_nonfinite, torch.zeros_like(sample_mask), sample_mask)
    batch["token_mask"], batch["sample_mask"] = token_mask, sample_mask

    after = (token_mask > 0) & (sample_mask > 0)[:, None]
    num_tokens, num_seqs = int(valid.sum()), int(eligible.sum())

    def frac(flags: torch.Tensor, total: int) -> float:
        return int(flags.sum()) / total if total else 0.0

    token_ratio = _summary(bounded_exp(log_ratio[valid]))
    to_value = bounded_exp if ratio_stat else (lambda x: x)
    seq_values = torch.cat([to_value(high[eligible]), to_value(low[eligible])]) if statistic == "max" else to_value(high[eligible])
    seq_summary = _summary(seq_values)
    if statistic == "max":
        seq_summary["std"] = _summary(to_value(high[eligible]))["std"]
    prefix = "rollout_rejection/"
    return {
        f"{prefix}token_ratio_max": token_ratio["max"],
        f"{prefix}token_ratio_min": token_ratio["min"],
        f"{prefix}token_ratio_std": token_ratio["std"],
        f"{prefix}token_frac_above": frac(tok_above, num_tokens),
        f"{prefix}token_frac_below": frac(tok_below, num_tokens),
        f"{prefix}seq_stat_max": seq_summary["max"],
        f"{prefix}seq_stat_min": seq_summary["min"],
        f"{prefix}seq_stat_std": seq_summary["std"],
        f"{prefix}seq_frac_above": frac(seq_above, num_seqs),
        f"{prefix}seq_frac_below": frac(seq_below, num_seqs),
        f"{prefix}token_frac_nonfinite": frac(tok_nonfinite, num_tokens),
        f"{prefix}seq_frac_nonfinite": frac(seq_nonfinite, num_seqs),
        f"{prefix}masked_token_fraction": frac(valid & ~after, num_tokens),
        f"{prefix}masked_seq_fraction": frac(eligible & ~(sample_mask > 0), num_seqs),
    }


def apply_driver_masks(cfg: MasterConfig, batch: Batch, rewards: torch.Tensor) -> dict[str, float]:
    """``grpo.seq_logprob_error_threshold``, then ``grpo.rollout_rejection``, on ``batch`` in place
    (after the prev-logprob pass, before ``policy.train`` counts valid tokens and sequences)."""
    metrics = mask_high_mismatch_sequences(cfg.grpo.seq_logprob_error_threshold, batch, rewards)
    metrics.update(apply_rollout_rejection(cfg.grpo.rollout_rejection, batch))
    drop_rows_without_tokens(batch)
    return metrics


def drop_rows_without_tokens(batch: Batch) -> None:
    """Remove from ``sample_mask`` every row with no token to train on (a failed agent session's placeholder row,
    which still took part in its group's baseline): counted as a sequence it diluted every seq-mean loss and
    ``train/num_valid_seqs``, and its empty mean logprob added exp(0) = 1 to the per-sequence perplexities."""
    empty = ~(batch["token_mask"] > 0).any(dim=-1)
    batch["sample_mask"] = torch.where(empty, torch.zeros_like(batch["sample_mask"]), batch["sample_mask"])
