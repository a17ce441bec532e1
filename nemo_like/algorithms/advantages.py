"""Advantage estimators (GRPO, RLOO, Dr. GRPO) behind a small registry, plus their metrics.

Every estimator maps per-sample rewards ``[B]`` to per-sample advantages ``[B]``; the caller broadcasts
them over the response tokens (``advantages[:, None] * token_mask``). Samples of the same prompt form
a group (``prompt_ids``: ``[B]`` ids or ``[B, L]`` prompt rows). See ``docs/guides/advantages.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from nemo_like.algorithms.utils import (
    _prompt_group_index,
    calculate_baseline_and_std_per_prompt,
    normalize_advantages_with_epsilon,
)
from nemo_like.config.errors import ConfigError
from nemo_like.utils.registry import Registry


@dataclass
class AdvantageResult:
    """Per-sample outputs of an estimator, all ``[B]``.

    Attributes:
        advantages: the advantages; exactly 0 for invalid samples.
        baseline: the baseline subtracted from each reward.
        std: the reward std the estimator used (or would have used) for normalisation; kept for logging.
    """

    advantages: torch.Tensor
    baseline: torch.Tensor
    std: torch.Tensor


class AdvantageEstimator(Protocol):
    """Signature of a registered estimator (keyword arguments, as passed by ``compute_advantages``)."""

    def __call__(
        self,
        *,
        rewards: torch.Tensor,
        prompt_ids: torch.Tensor,
        valid_mask: torch.Tensor,
        normalize_rewards: bool,
        use_leave_one_out_baseline: bool,
        epsilon: float,
    ) -> AdvantageResult: ...


#: ``grpo.adv_estimator.name`` values. A recipe may also name user code as ``module:function``
#: (an :class:`AdvantageEstimator`), without registering it.
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "grpo.adv_estimator.name")


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering an estimator under ``name`` (the value of ``grpo.adv_estimator.name``).

    Raises:
        ValueError: if ``name`` is already registered (a silent override would change training math).
    """
    return ADVANTAGE_ESTIMATORS.register(name)


def compute_advantages(
    name: str,
    *,
    rewards: torch.Tensor,
    prompt_ids: torch.Tensor,
    valid_mask: torch.Tensor,
    normalize_rewards: bool,
    use_leave_one_out_baseline: bool,
    epsilon: float = 1e-6,
) -> AdvantageResult:
    """Run the estimator registered as ``name``.

    Args:
        name: a name registered in ``ADVANTAGE_ESTIMATORS`` (``grpo``, ``rloo``, ``dr_grpo``, ...) or a
            ``module:function`` import path.
        rewards: ``[B]`` rewards (NaN/inf raise ``ValueError``).
        prompt_ids: ``[B]`` group ids or ``[B, L]`` prompt token rows.
        valid_mask: ``[B]`` 0/1; invalid samples enter no baseline and get advantage 0.
        normalize_rewards: divide by the per-prompt std (estimators may ignore it, see each one).
        use_leave_one_out_baseline: leave-one-out baseline (estimators may ignore it, see each one).
        epsilon: added to positive stds when normalising.

    Raises:
        ValueError: unknown ``name`` (the message suggests the closest and lists the registered names).
        ConfigError: the estimator (a user's, by import path) returned no :class:`AdvantageResult`, advantages of
            another shape than ``rewards`` or non-finite ones (they had failed deep in the loop, or skipped every
            update as a "non-finite loss" that blamed the learning rate).
    """
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    result = estimator(
        rewards=rewards,
        prompt_ids=prompt_ids,
        valid_mask=valid_mask,
        normalize_rewards=normalize_rewards,
        use_leave_one_out_baseline=use_leave_one_out_baseline,
        epsilon=epsilon,
    )
    key = f"grpo.adv_estimator.name={name!r}"
    if not isinstance(result, AdvantageResult):
        raise ConfigError(f"{key} returned a {type(result).__name__}, not an AdvantageResult(advantages, baseline, std)")
    if tuple(result.advantages.shape) != tuple(rewards.shape):
        raise ConfigError(f"{key} returned advantages of shape {tuple(result.advantages.shape)}, not the rewards' {tuple(rewards.shape)}")
    if not bool(torch.isfinite(result.advantages).all()):
        bad = int((~torch.isfinite(result.advantages)).sum())
        raise ConfigError(f"{key} returned {bad} non-finite advantages of {result.advantages.numel()} (finite rewards in)")
    return result


def _baseline_advantages(
    rewards: torch.Tensor,
    prompt_ids: torch.Tensor,
    valid_mask: torch.Tensor,
    *,
    leave_one_out: bool,
    normalize: bool,
    epsilon: float,
) -> AdvantageResult:
    baseline, std = calculate_baseline_and_std_per_prompt(prompt_ids, rewards, valid_mask, leave_one_out)
    advantages = rewards.to(baseline.dtype) - baseline
    if leave_one_out:
        # Scale by the whole group's std: the others' std is 0 or tiny when they (nearly) agree, and dividing by it
        # gave one sample of [1, 0, ..., 0, 0.01] an advantage of 264. The group's is 0 only when every reward is equal.
        std = calculate_baseline_and_std_per_prompt(prompt_ids, rewards, valid_mask, False)[1]
    if normalize:
        advantages = normalize_advantages_with_epsilon(advantages, std, epsilon)
    advantages = torch.where(valid_mask.to(torch.bool), advantages, torch.zeros_like(advantages))
    return AdvantageResult(advantages=advantages, baseline=baseline, std=std)


@register_advantage_estimator("grpo")
def grpo_advantages(
    *,
    rewards: torch.Tensor,
    prompt_ids: torch.Tensor,
    valid_mask: torch.Tensor,
    normalize_rewards: bool,
    use_leave_one_out_baseline: bool,
    epsilon: float,
) -> AdvantageResult:
    """GRPO: ``A_i = (r_i - b_i) / (s + eps)`` with the group (or leave-one-out) mean ``b_i`` and the group's std ``s``.

    The division only happens when ``normalize_rewards`` and only where ``s > 0``.
    """
    return _baseline_advantages(
        rewards,
        prompt_ids,
        valid_mask,
        leave_one_out=use_leave_one_out_baseline,
        normalize=normalize_rewards,
        epsilon=epsilon,
    )


@register_advantage_estimator("rloo")
def rloo_advantages(
    *,
    rewards: torch.Tensor,
    prompt_ids: torch.Tensor,
    valid_mask: torch.Tensor,
    normalize_rewards: bool,
    use_leave_one_out_baseline: bool,
    epsilon: float,
) -> AdvantageResult:
    """RLOO: ``A_i = r_i - mean_{j != i} r_j``, always leave-one-out (``use_leave_one_out_baseline`` is ignored).

    Classic RLOO does not divide by a std; we still honour ``normalize_rewards`` (divide by the
    group's std where it is positive) so that switching estimator never silently changes the
    reward scale. Set ``grpo.normalize_rewards: false`` for textbook RLOO.
    """
    del use_leave_one_out_baseline
    return _baseline_advantages(rewards, prompt_ids, valid_mask, leave_one_out=True, normalize=normalize_rewards, epsilon=epsilon)


@register_advantage_estimator("dr_grpo")
def dr_grpo_advantages(
    *,
    rewards: torch.Tensor,
    prompt_ids: torch.Tensor,
    valid_mask: torch.Tensor,
    normalize_rewards: bool,
    use_leave_one_out_baseline: bool,
    epsilon: float,
) -> AdvantageResult:
    """Dr. GRPO: ``A_i = r_i - mean_group(r)``; never divides by the std (its question-difficulty bias).

    Both ``normalize_rewards`` and ``use_leave_one_out_baseline`` are ignored; ``std`` is the group std,
    returned for logging only.
    """
    del normalize_rewards, use_leave_one_out_baseline
    return _baseline_advantages(rewards, prompt_ids, valid_mask, leave_one_out=False, normalize=False, epsilon=epsilon)


def advantage_metrics(advantages_bs: torch.Tensor, token_mask: torch.Tensor) -> dict[str, float]:
    """``advantages/{mean,max,min}`` over the tokens where ``token_mask`` is 1 (all 0.0 when there are none).

    Args:
        advantages_bs: ``[B, S]`` per-token advantages (a ``[B]`` tensor is broadcast over ``S``).
        token_mask: ``[B, S]`` 0/1 mask of the response tokens that count.
    """
    if advantages_bs.dim() == 1 and token_mask.dim() == 2:
        advantages_bs = advantages_bs[:, None].expand_as(token_mask)
    values = advantages_bs.masked_select(token_mask.to(torch.bool)).double()
    if values.numel() == 0:
        return {"advantages/mean": 0.0, "advantages/max": 0.0, "advantages/min": 0.0}
    return {
        "advantages/mean": values.mean().item(),
        "advantages/max": values.max().item(),
        "advantages/min": values.min().item(),
    }


def reward_group_metrics(rewards: torch.Tensor, prompt_ids: torch.Tensor, valid_mask: torch.Tensor) -> dict[str, float]:
    """Reward spread across the batch and within prompt groups; only valid samples count.

    Returns:
        ``reward_std``: Bessel std of the valid rewards of the batch (0.0 with fewer than 2);
        ``frac_reward_zero_std``: fraction of groups (with >= 1 valid sample) whose rewards are all equal
        (no learning signal; a single-sample group counts as zero std);
        ``baseline_reward/pct_0``, ``baseline_reward/pct_1``, ``baseline_reward/pct_mixed``: fraction of
        those groups whose rewards are all exactly 0, all exactly 1, or whose mean is strictly between (not
        all 0 or all 1); a group of other rewards with a mean of 0, 1 or outside [0, 1] (``[-1, 1]``) falls in
        none of the three. All 0.0 when no sample is valid.
    """
    valid = valid_mask.to(torch.bool)
    r = rewards.to(torch.float64)
    zeros = {
        "reward_std": 0.0,
        "frac_reward_zero_std": 0.0,
        "baseline_reward/pct_0": 0.0,
        "baseline_reward/pct_1": 0.0,
        "baseline_reward/pct_mixed": 0.0,
    }
    if not bool(valid.any()):
        return zeros
    group = _prompt_group_index(prompt_ids)[valid]
    r = r[valid]
    num_groups = int(group.max()) + 1
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(r))
    present = count > 0  # groups whose samples are all invalid were dropped above
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, r) / count.clamp(min=1)
    g_min = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce_(0, group, r, "amin")
    g_max = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, group, r, "amax")
    # Group mean of 0 / 1 judged on min/max, so that rounding in the mean cannot misclassify.
    all_zero, all_one = (g_max == 0) & (g_min == 0), (g_max == 1) & (g_min == 1)
    mixed = (mean > 0) & (mean < 1) & ~all_zero & ~all_one
    n = present.sum().double()

    def frac(flags: torch.Tensor) -> float:
        return ((flags & present).sum().double() / n).item()

    return {
        "reward_std": r.std().item() if r.numel() > 1 else 0.0,
        "frac_reward_zero_std": frac(g_min == g_max),
        "baseline_reward/pct_0": frac(all_zero),
        "baseline_reward/pct_1": frac(all_one),
        "baseline_reward/pct_mixed": frac(mixed),
    }
