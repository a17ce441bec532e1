"""User code named by import path in recipes (``tests.unit.algorithms.user_plugins:NAME``): not registered."""

from __future__ import annotations

import torch

from nemo_like.algorithms.advantages import AdvantageResult


def best_of_group_advantages(
    *,
    rewards: torch.Tensor,
    prompt_ids: torch.Tensor,
    valid_mask: torch.Tensor,
    normalize_rewards: bool,
    use_leave_one_out_baseline: bool,
    epsilon: float,
) -> AdvantageResult:
    """A_i = r_i - max reward of the group (so the best sample gets 0, the others are pushed down)."""
    group = torch.unique(prompt_ids, return_inverse=True)[1]
    best = torch.full((int(group.max()) + 1,), -torch.inf, dtype=torch.float64)
    best = best.scatter_reduce(0, group, rewards.double(), reduce="amax")[group]
    advantages = torch.where(valid_mask.bool(), rewards.double() - best, 0.0)
    return AdvantageResult(advantages=advantages, baseline=best, std=torch.zeros_like(best))


def abs_log_ratio_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """A user per-token 'KL': |log pi_ref - log pi|."""
    return log_ratio.abs()


NOT_CALLABLE = 3


def keep_every_token(inputs, low: float, high: float) -> torch.Tensor:
    """A user trust region that masks nothing."""
    return inputs.valid


def mean_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """A mistaken 'KL' estimator: one number, not per token (broadcast, it computed another penalty)."""
    return log_ratio.abs().mean()


def float_keep(inputs, low: float, high: float) -> torch.Tensor:
    """A mistaken trust region: a float mask, not a bool one."""
    return inputs.valid.float()


def bare_surrogate(log_ratio, inputs, cfg) -> torch.Tensor:
    """A mistaken surrogate: the per-token loss alone, not a Surrogate."""
    return -inputs.advantages * log_ratio.exp()
