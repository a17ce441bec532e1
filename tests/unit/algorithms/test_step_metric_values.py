"""The values of the step metrics and lines a user reads, by hand: each was only checked for presence, ranges or
agreement between two runs of the same code, so a wrong formula (the last optimizer step's norm for the mean, a
swapped ratio) passed every test."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_like.algorithms.grpo import (
    async_generation_metrics,
    format_timing,
    progress_info,
    trajectory_age_metrics,
    update_metrics,
    validation_line,
)
from nemo_like.data.prompts import PromptRecord
from nemo_like.experience.async_rollouts import TakenRollout
from nemo_like.experience.rollouts import Rollout
from nemo_like.experience.trajectory_collector import GenerationStats
from nemo_like.models.generation.interface import GeneratedSample
from nemo_like.models.policy.policy import TrainResult
from nemo_like.train import summarise
from nemo_like.utils.throughput import TRAINED_TOKENS


def train_result(grad_norms: list[float], forward_tokens: int = 300, trained_tokens: int = 200) -> TrainResult:
    return TrainResult(
        metrics={}, grad_norms=grad_norms, lr=2e-5, nonfinite_steps_skipped=1, first_step_logprobs=None,
        empty_steps_skipped=2, forward_tokens=forward_tokens, trained_tokens=trained_tokens,
    )  # fmt: skip


def test_update_metrics() -> None:
    """train/grad_norm is the mean over the call's optimizer steps (NaN when none updated the weights); the trainable
    share is trainable / total; forward tokens per trained token divides by the tokens trained on."""
    metrics = update_metrics(train_result([1.0, 3.0]), weight_version=7, trainable_params=10, total_params=1000)
    assert metrics == {
        "train/grad_norm": 2.0,
        "train/lr": 2e-5,
        "train/nonfinite_steps_skipped": 1.0,
        "train/empty_steps_skipped": 2.0,
        "train/weight_version": 7.0,
        "train/trainable_params": 10.0,
        "train/trainable_fraction": 0.01,
        TRAINED_TOKENS: 200.0,
        "performance/training_forward_tokens_per_token": 1.5,
    }
    assert math.isnan(update_metrics(train_result([]), 7, 10, 1000)["train/grad_norm"])
    no_tokens = update_metrics(train_result([1.0], forward_tokens=0, trained_tokens=0), 7, 10, 0)
    assert no_tokens["performance/training_forward_tokens_per_token"] == 0.0 and no_tokens["train/trainable_fraction"] == 10.0


def sample(weight_version: int, final_weight_version: int) -> GeneratedSample:
    return GeneratedSample([1], [2], [-0.5], False, weight_version, final_weight_version)


def test_async_generation_metrics() -> None:
    """Tokens per second divide by the generation seconds (0 when it generated nothing); the mid-sequence refit share
    counts the trained samples whose weights changed while they were generated."""
    samples = [sample(3, 4), sample(3, 3), sample(4, 4), sample(4, None)]
    prompt = PromptRecord(id="p", messages=[], prompt_token_ids=[1], metadata={})
    rollout = Rollout([prompt] * 4, torch.tensor([0, 0, 1, 1]), samples, ["x"] * 4, torch.zeros(4))
    taken = TakenRollout(rollout, ages=[1, 1, 0, 0], waited_s=0.5, buffer_size=3)
    generated = GenerationStats(generation_seconds=4.0, reward_seconds=0.25, reference_seconds=0.75, generated_tokens=100.0,
                                batches=2, waiting_for_pacing=1.5, paused_for_checkpoint=0.125,
                                paused_for_validation=0.0625)  # fmt: skip
    assert async_generation_metrics(taken, generated, generation_weight_version=5) == {
        "async/buffer_size": 3.0,
        "async/generation_weight_version": 5.0,
        "async/refitted_mid_sequence_fraction": 0.25,
        "async/generation_seconds": 4.0,
        "async/reward_seconds": 0.25,
        "async/reference_logprob_seconds": 0.75,
        "async/generation_batches": 2.0,
        "async/generation_tokens_per_sec": 25.0,
        "idle/trainer_waiting_for_data": 0.5,
        "idle/generation_paused_for_checkpoint": 0.125,
        "idle/generation_paused_for_validation": 0.0625,
        "idle/generation_waiting_for_pacing": 1.5,
        "performance/num_generated_tokens": 100.0,
    }
    assert async_generation_metrics(taken, GenerationStats(), 5)["async/generation_tokens_per_sec"] == 0.0


def test_trajectory_age_metrics() -> None:
    assert trajectory_age_metrics([0, 1, 1, 2], max_age=3) == {
        "train/avg_trajectory_age": 1.0,
        "train/max_trajectory_age": 2.0,
        "train/trajectory_age_fraction/0": 0.25,
        "train/trajectory_age_fraction/1": 0.5,
        "train/trajectory_age_fraction/2": 0.25,
        "train/trajectory_age_fraction/3": 0.0,
    }


def test_the_console_timing_line() -> None:
    """Each phase's seconds and share of the step, in STEP_PHASES order; a phase that took no time is left out."""
    metrics = {"timing/train/total_step_time": 4.0, "timing/train/policy_training": 1.0, "timing/train/generation": 3.0,
               "timing/train/reward": 0.0}  # fmt: skip
    assert format_timing(metrics) == "[timing] step 4.00s: generation 3.00s (75%), policy_training 1.00s (25%)"


@pytest.mark.parametrize(
    ("history", "line"),
    [
        (
            [{"step": 0, "validation/accuracy": 0.1}, {"step": 1}, {"step": 10, "validation/accuracy": 0.35}],
            "[done] 3 records in 12s; validation/accuracy 0.100 (step 0) -> 0.350 (step 10), +25.0 points",
        ),
        (
            [{"step": 0, "validation/accuracy": 0.5}, {"step": 5, "validation/accuracy": 0.25}],
            "[done] 2 records in 12s; validation/accuracy 0.500 (step 0) -> 0.250 (step 5), -25.0 points",
        ),  # fmt: skip
        ([{"step": 1}, {"step": 2, "validation/accuracy": 0.5}], "[done] 2 records in 12s"),  # one validation: no change
    ],
)
def test_the_end_of_run_line(history: list[dict], line: str) -> None:
    assert summarise(history, 12.0) == line


def test_the_console_progress_and_validation_lines() -> None:
    assert progress_info({"train/reward": 0.25, "train/loss": 0.5}) == "reward=0.250 loss=0.5000"
    assert progress_info({"train/reward": 0.25, "train/loss": 0.5, "validation/accuracy": 0.75}) == "reward=0.250 loss=0.5000 val_acc=0.750"
    assert validation_line(0, {"validation/accuracy": 0.75}) == "[step 0] validation/accuracy=0.750"
