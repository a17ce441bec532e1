"""With DAPO overlong shaping the advantages use the shaped rewards, while train/reward, the reward-group and task
metrics, the sample dump's reward and the mismatch mask's correct fraction report the task's rewards (they were
shaped: a policy answering more questions right at greater length showed a falling train/reward)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import nemo_like.algorithms.grpo as grpo
from nemo_like.algorithms.rejection import mask_high_mismatch_sequences
from nemo_like.config.schema import MasterConfig
from nemo_like.data.prompts import PromptRecord
from nemo_like.experience.rollouts import Rollout, task_reward_metrics
from nemo_like.models.generation.interface import GeneratedSample
from nemo_like.utils.timer import StepTimer

# Prompt 0: four correct answers of 60 tokens, inside the 16-token overlong buffer below 64; prompt 1: one of four, long.
RAW = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
LENGTHS = [60, 60, 60, 60, 10, 10, 60, 10]
SHAPED_1 = [0.0, 0.0, 1 - 12 / 16, 0.0]  # prompt 1's shaped rewards


def _batch(generation, environment, tokenizer, prompts, *args, **kwargs) -> Rollout:
    samples = [GeneratedSample([1], [2] * n, [0.0] * n, False, 0) for n in LENGTHS]
    group_ids = torch.arange(2).repeat_interleave(4)
    return Rollout([prompts[g] for g in group_ids.tolist()], group_ids, samples, ["x"] * 8, torch.tensor(RAW), {})


def _rollout(monkeypatch, *overrides: tuple[str, object]) -> tuple[MasterConfig, Rollout, dict]:
    monkeypatch.setattr(grpo, "collect_rollout", _batch)
    grpo_cfg = {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, **dict(overrides)}
    grpo_cfg["reward_shaping"] = {"enabled": True, "overlong_buffer_length": 16, "max_response_length": 64}
    cfg = MasterConfig.model_validate({"grpo": grpo_cfg, "policy": {"train_global_batch_size": 8, "train_micro_batch_size": 8}})
    prompts = [PromptRecord(f"p{i}", [], [1], {"task_name": "arithmetic"}) for i in range(2)]
    loader = SimpleNamespace(next_batch=lambda: prompts, state_dict=lambda: {}, next_batch_epoch=0)
    parts = SimpleNamespace(cfg=cfg, generation=None, environment=None, tokenizer=None, train_loader=loader,
                            plan=SimpleNamespace(multi_turn=None, overlap_scoring=False))  # fmt: skip
    rollout, metrics = grpo.collect_training_rollout(parts, 1, StepTimer())
    return cfg, rollout, metrics


def test_metrics_report_the_task_rewards_and_the_advantages_use_the_shaped_ones(monkeypatch) -> None:
    cfg, rollout, _ = _rollout(monkeypatch)
    assert rollout.raw_rewards.tolist() == RAW and rollout.raw_rewards.mean().item() == 0.625  # train/reward
    assert rollout.rewards[:4].tolist() == pytest.approx([1 - 12 / 16] * 4) and rollout.rewards[4:].tolist() == SHAPED_1  # shaped
    batch = {"sample_mask": torch.ones(8), "token_mask": torch.ones(8, 1)}
    metrics = grpo.attach_advantages(cfg, batch, rollout)
    assert metrics["baseline_reward/pct_1"] == 0.5 and metrics["baseline_reward/pct_mixed"] == 0.5  # prompt 0 solved
    assert batch["advantages"][:4].abs().max().item() == 0.0  # its equal shaped rewards: no signal, as before
    assert task_reward_metrics(rollout.prompts, rollout.raw_rewards, ["arithmetic"])["env/arithmetic/reward"] == 0.625


def test_dynamic_sampling_keeps_the_task_rewards_of_the_kept_groups(monkeypatch) -> None:
    _, rollout, metrics = _rollout(monkeypatch, ("use_dynamic_sampling", True))
    assert metrics["dynamic_sampling/num_gen_batches"] == 2.0  # one group with raw-reward signal per batch
    assert rollout.raw_rewards.tolist() == RAW[4:] * 2 and rollout.rewards.tolist() == SHAPED_1 * 2
    # What was generated, the solved (discarded) groups included: the trained groups alone always show pct_1 = 0
    assert metrics["dynamic_sampling/generated_reward"] == 0.625 and metrics["dynamic_sampling/generated_pct_1"] == 0.5
    assert metrics["dynamic_sampling/generated_pct_0"] == 0.0 and metrics["dynamic_sampling/generated_frac_reward_zero_std"] == 0.5


def test_the_mismatch_masks_correct_fraction_counts_correct_answers_not_positive_rewards() -> None:
    """A format reward of 0.1 made three wrong answers count as correct."""
    batch = {"token_mask": torch.ones(4, 4), "sample_mask": torch.ones(4), "prev_logprobs": torch.zeros(4, 4)}
    batch["generation_logprobs"] = torch.full((4, 4), -1.0)  # every sample past the threshold below
    metrics = mask_high_mismatch_sequences(2.0, batch, torch.tensor([0.1, 0.1, 0.1, 1.0]))
    assert metrics["seq_logprob_error/num_masked"] == 4.0 and metrics["seq_logprob_error/masked_correct_fraction"] == 0.25
