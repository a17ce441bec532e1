"""Agent tasks: a branched session (several rows) weighs once in its group's baseline, and each of its rows takes its
session's advantage; validation and `nemo-like eval` count it as one sample."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_like.algorithms import grpo
from nemo_like.algorithms.grpo import attach_advantages
from nemo_like.config import DEFAULT_RECIPE, ConfigError, load_config
from nemo_like.data.prompts import PromptRecord
from nemo_like.evaluation.run import result_rows, summarize
from nemo_like.experience.rollouts import Rollout
from nemo_like.models.generation.interface import GeneratedSample

BRANCHED_SESSIONS = torch.tensor([0, 0, 0, 1, 2, 3])


def test_a_branched_session_counts_once_in_its_groups_baseline() -> None:
    cfg = load_config(DEFAULT_RECIPE, ["grpo.normalize_rewards=false", "grpo.use_leave_one_out_baseline=false"], warn=False)
    # One prompt, three sessions: session 7 branched into rows 0 and 1 (reward 1), sessions 8 and 9 one row each (0, 0).
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    rollout = Rollout([], torch.zeros(4, dtype=torch.long), [], [], rewards, session_of_row=torch.tensor([7, 7, 8, 9]))
    batch = {"token_mask": torch.ones(4, 2), "sample_mask": torch.ones(4)}
    metrics = attach_advantages(cfg, batch, rollout)
    # Per session: mean reward 1/3, so session 7's rows get 2/3 each, the others -1/3 (per row it would be 0.5 / -0.5).
    torch.testing.assert_close(batch["advantages"][:, 0], torch.tensor([2 / 3, 2 / 3, -1 / 3, -1 / 3]))
    # The reward spread and train/reward count sessions too (per row: std 0.577, reward 0.5)
    assert metrics["reward_std"] == pytest.approx(torch.tensor([1.0, 0.0, 0.0]).std().item())
    assert grpo.session_rewards(rollout).mean().item() == pytest.approx(1 / 3)
    plain = Rollout([], torch.zeros(4, dtype=torch.long), [], [], rewards)
    attach_advantages(cfg, batch, plain)
    torch.testing.assert_close(batch["advantages"][:, 0], torch.tensor([0.5, 0.5, -0.5, -0.5]))


def test_the_runs_advantage_std_epsilon_damps_a_near_tie_group() -> None:
    """grpo.advantage_std_epsilon reaches the estimator: a group of scores 0.50/0.51 gets +-0.866 at the default (as
    large as a 0/1 group's) and (r - mean) / (std + 0.05) = +-0.005 / 0.0558 at 0.05; the 0/1 group barely moves."""
    rewards = torch.tensor([0.50, 0.51, 0.50, 0.51, 0.0, 1.0, 0.0, 1.0])
    rollout = Rollout([], torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), [], [], rewards)
    batch = {"token_mask": torch.ones(8, 2), "sample_mask": torch.ones(8)}
    signs = torch.tensor([-1.0, 1.0, -1.0, 1.0])
    attach_advantages(load_config(DEFAULT_RECIPE, [], warn=False), batch, rollout)
    torch.testing.assert_close(batch["advantages"][:, 0], torch.cat([signs, signs]) * 0.8660, atol=1e-3, rtol=0)
    attach_advantages(load_config(DEFAULT_RECIPE, ["grpo.advantage_std_epsilon=0.05"], warn=False), batch, rollout)
    near_tie = 0.005 / (torch.tensor([0.50, 0.51, 0.50, 0.51]).std().item() + 0.05)
    one_zero = 0.5 / (torch.tensor([0.0, 1.0, 0.0, 1.0]).std().item() + 0.05)
    torch.testing.assert_close(batch["advantages"][:, 0], torch.cat([signs * near_tie, signs * one_zero]), atol=1e-5, rtol=0)


def branched_rollout(session_of_row: torch.Tensor | None = BRANCHED_SESSIONS) -> Rollout:
    """Two prompts x two agent sessions: prompt 0's session 0 is correct and branched into 3 rows, its session 1 wrong
    (reward 0.5); prompt 1's sessions 2 and 3 are wrong. Per session: accuracy 1/4, reward 1.5/4, pass@1 1/4,
    pass@2 1/2; per row it would be 3/6, 3.5/6, 3/8 and 1/2."""
    prompts = [PromptRecord(f"p{i}", [], [1], {"answer": i, "task_name": "arithmetic"}) for i in (0, 1)]
    groups = [0, 0, 0, 0, 1, 1]
    return Rollout(
        [prompts[g] for g in groups],
        torch.tensor(groups),
        [GeneratedSample([1], [5] * length, [-0.1] * length, False, 0) for length in (1, 2, 3, 4, 5, 6)],
        ["42", "42", "42", "7", "7", "7"],
        torch.tensor([1.0, 1.0, 1.0, 0.5, 0.0, 0.0]),
        session_of_row=session_of_row,
    )


def test_validation_counts_a_branched_session_once(monkeypatch) -> None:
    """validate() counted every row of a branched session as a sample: a correct session with 3 rows was 3 correct
    samples (accuracy 0.5 and pass@1 0.375 here instead of 0.25)."""
    cfg = load_config(DEFAULT_RECIPE, ["grpo.val_num_generations_per_prompt=2"], warn=False)
    parts = SimpleNamespace(
        cfg=cfg,
        generation=None,
        environment=SimpleNamespace(tasks=["arithmetic"]),
        tokenizer=None,
        val_prompts=[],
        plan=SimpleNamespace(multi_turn=None),
    )
    monkeypatch.setattr(grpo, "report_val_samples", lambda *args: None)
    monkeypatch.setattr(grpo, "collect_rollout", lambda *args, **kwargs: branched_rollout())
    metrics = grpo.validate(parts, 0)
    assert metrics["validation/accuracy"] == 0.25 and metrics["validation/reward"] == pytest.approx(1.5 / 4)
    assert metrics["validation/pass@1"] == 0.25 and metrics["validation/pass@2"] == 0.5
    assert metrics["validation/num_samples"] == 4 and metrics["validation/num_rows"] == 6
    assert metrics["validation/env/arithmetic/reward"] == pytest.approx(1.5 / 4) and metrics["validation/env/arithmetic/num_samples"] == 4
    # Sampled tokens per session: rows 1+2+3 are one session, then 4, 5, 6 (per row the mean was 3.5)
    assert metrics["validation/mean_response_length"] == 21 / 4
    # Without sessions (every other task) each row is a sample, as before, and there is no num_rows.
    monkeypatch.setattr(grpo, "collect_rollout", lambda *args, **kwargs: branched_rollout(None))
    rows = grpo.validate(parts, 0)
    assert rows["validation/accuracy"] == 0.5 and rows["validation/pass@1"] == pytest.approx(3 / 8) and rows["validation/num_samples"] == 6
    assert "validation/num_rows" not in rows and rows["validation/mean_response_length"] == 3.5


def test_training_reward_metrics_count_a_branched_session_once_as_validation_does() -> None:
    """env/<task>/reward and /num_samples counted rows while train/reward counted sessions (3.5/6 against 1.5/4)."""
    metrics = grpo.training_reward_metrics(branched_rollout(), ["arithmetic"])
    assert metrics["train/reward"] == pytest.approx(1.5 / 4) and metrics["env/arithmetic/reward"] == pytest.approx(1.5 / 4)
    assert metrics["env/arithmetic/num_samples"] == 4
    rows = grpo.training_reward_metrics(branched_rollout(None), ["arithmetic"])
    assert rows["env/arithmetic/reward"] == pytest.approx(3.5 / 6) and rows["env/arithmetic/num_samples"] == 6
    assert "train/shaped_reward" not in metrics
    # Shaped rewards (what the advantages used) over the same samples: with nothing shaped away, equal to train/reward
    # (per row the branched session's 1.0 counted three times: 3.5/6 beside a train/reward of 1.5/4).
    shaped = branched_rollout()
    shaped.set_shaped_rewards(shaped.rewards.clone())
    assert grpo.training_reward_metrics(shaped, ["arithmetic"], shaped=True)["train/shaped_reward"] == pytest.approx(1.5 / 4)
    shaped.set_shaped_rewards(torch.tensor([0.5, 0.5, 0.5, 0.5, 0.0, 0.0]))
    assert grpo.training_reward_metrics(shaped, ["arithmetic"], shaped=True)["train/shaped_reward"] == pytest.approx(1.0 / 4)


def test_a_session_is_truncated_where_one_of_its_rows_is() -> None:
    """train/truncated_fraction per session: a branched multi-turn episode's earlier rows are never cut (a cut turn
    ends it), so per row its last row's cut was diluted by its other rows (2/6 here against 2/4)."""
    rollout = branched_rollout()
    rollout.samples = [replace(s, truncated=i in (2, 5)) for i, s in enumerate(rollout.samples)]
    assert grpo.session_truncated(rollout).tolist() == [1.0, 0.0, 0.0, 1.0]
    assert grpo.session_truncated(branched_rollout(None)).tolist() == [0.0] * 6


def test_dynamic_sampling_counts_a_generated_branched_session_once(monkeypatch) -> None:
    """dynamic_sampling/generated_* over every generation batch: a branched session weighs once, as in train/reward."""
    from nemo_like.config.schema import MasterConfig
    from nemo_like.data.prompts import PromptDataLoader
    from nemo_like.utils.timer import StepTimer

    saturated = branched_rollout()
    saturated.rewards = torch.zeros(6)  # every group's rewards equal: dropped, and a second batch is generated
    batches = iter([saturated, branched_rollout(), branched_rollout()])  # one group with reward variance in each of the last two
    monkeypatch.setattr(grpo, "collect_rollout", lambda *args, **kwargs: next(batches))
    cfg = MasterConfig.model_validate(
        {
            "grpo": {"use_dynamic_sampling": True, "num_prompts_per_step": 2, "num_generations_per_prompt": 2},
            "policy": {"train_global_batch_size": 4, "train_micro_batch_size": 1},
        }
    )
    loader = PromptDataLoader([PromptRecord(f"p{i}", [], [1], {"task_name": "arithmetic"}) for i in range(4)], 2, 0, False)
    parts = SimpleNamespace(cfg=cfg, generation=None, environment=None, tokenizer=None, train_loader=loader,
                            plan=SimpleNamespace(multi_turn=None, overlap_scoring=False))  # fmt: skip
    _, metrics = grpo.collect_training_rollout(parts, 1, StepTimer())
    # Twelve sessions over the three batches (per row: eighteen, the branched correct one three times a batch: 7/18).
    assert metrics["dynamic_sampling/generated_reward"] == pytest.approx(3.0 / 12)
    assert metrics["dynamic_sampling/generated_pct_0"] == pytest.approx(4 / 6)  # groups all wrong: 4 of 6 (a fraction)


def test_eval_counts_a_branched_session_once_and_numbers_rows_by_session() -> None:
    """`nemo-like eval` counted rows as samples (accuracy 0.5 here) and numbered them ``i % n`` (0,1,0,1,0,1: the three
    rows of one session read as different samples)."""
    rows = result_rows(branched_rollout(), {"arithmetic": None}, 2)
    assert [(r["session"], r["sample_index"]) for r in rows] == [(0, 0), (0, 0), (0, 0), (1, 1), (2, 0), (3, 1)]
    summary = summarize(rows, [1, 2])
    assert summary["accuracy"] == 0.25 and summary["mean_reward"] == pytest.approx(1.5 / 4)
    assert summary["pass@1"] == 0.25 and summary["pass@2"] == 0.5 and summary["num_rows"] == 6
    assert summary["accuracy_per_task"] == {"arithmetic": 0.25}
    plain = result_rows(branched_rollout(None), {"arithmetic": None}, 2)  # every other task: a row is a sample
    assert [r["sample_index"] for r in plain] == [0, 1, 0, 1, 0, 1] and not any("session" in r for r in plain)
    assert summarize(plain, [1, 2])["accuracy"] == 0.5 and "num_rows" not in summarize(plain, [1, 2])


def test_overlong_shaping_measures_a_sessions_sampled_tokens_not_its_first_rows() -> None:
    """Every row of a session takes its session's reward (its first row's): shaped on per-row lengths, a branched
    session of 1 + 2 + 3 sampled tokens was judged by its first row's 1 token."""
    rollout = branched_rollout()
    assert grpo.shaping_lengths(rollout).tolist() == [6, 6, 6, 4, 5, 6]
    assert grpo.shaping_lengths(branched_rollout(None)).tolist() == [1, 2, 3, 4, 5, 6]
    cfg = load_config(None, ["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.overlong_buffer_length=2",
                             "grpo.reward_shaping.max_response_length=6"], warn=False)  # fmt: skip
    shaped = grpo.shaped_rewards(cfg, rollout.rewards, grpo.shaping_lengths(rollout))
    assert shaped[0].item() == shaped[2].item() < 1.0  # the branched session sampled 6 tokens: inside the ramp (5..6)


def test_reward_shaping_in_an_agent_run_needs_a_whole_session_budget() -> None:
    """Agent runs have max_rollout_turns 1, so the multi-turn rule did not apply: a session's many calls were measured
    against one call's max_new_tokens."""
    recipe = Path(__file__).resolve().parents[3] / "examples/configs/grpo_agent_tiny_cpu.yaml"
    shaping = ["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.overlong_buffer_length=4"]
    with pytest.raises(ConfigError, match=r"agent tasks \['tool'\].*set grpo.reward_shaping.max_response_length"):
        load_config(recipe, shaping, warn=False)
    assert load_config(recipe, [*shaping, "grpo.reward_shaping.max_response_length=64"], warn=False).grpo.reward_shaping.enabled
