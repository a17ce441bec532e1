"""Agent tasks: a branched session (several rows) weighs once in its group's baseline, and each of its rows takes its
session's advantage."""

from __future__ import annotations

import torch

from nemo_like.algorithms.grpo import attach_advantages
from nemo_like.config import DEFAULT_RECIPE, load_config
from nemo_like.experience.rollouts import Rollout


def test_a_branched_session_counts_once_in_its_groups_baseline() -> None:
    cfg = load_config(DEFAULT_RECIPE, ["grpo.normalize_rewards=false", "grpo.use_leave_one_out_baseline=false"], warn=False)
    # One prompt, three sessions: session 7 branched into rows 0 and 1 (reward 1), sessions 8 and 9 one row each (0, 0).
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    rollout = Rollout([], torch.zeros(4, dtype=torch.long), [], [], rewards, session_of_row=torch.tensor([7, 7, 8, 9]))
    batch = {"token_mask": torch.ones(4, 2), "sample_mask": torch.ones(4)}
    attach_advantages(cfg, batch, rollout)
    # Per session: mean reward 1/3, so session 7's rows get 2/3 each, the others -1/3 (per row it would be 0.5 / -0.5).
    torch.testing.assert_close(batch["advantages"][:, 0], torch.tensor([2 / 3, 2 / 3, -1 / 3, -1 / 3]))
    plain = Rollout([], torch.zeros(4, dtype=torch.long), [], [], rewards)
    attach_advantages(cfg, batch, plain)
    torch.testing.assert_close(batch["advantages"][:, 0], torch.tensor([0.5, 0.5, -0.5, -0.5]))
