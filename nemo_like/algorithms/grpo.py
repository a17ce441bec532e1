"""The GRPO loops. They read like single-process code; the heavy work runs in Ray actors.

``grpo_train`` (sync), per step: prompts -> G samples each -> rewards -> group advantages -> (prev,
reference logprobs, concurrently, each only when needed) -> train -> (next step) lazy refit of the
generation weights.

``async_grpo_train``: a trajectory-collector actor generates and scores prompt batches ahead of
training, paced so no sample is more than ``grpo.async_grpo.max_trajectory_age_steps`` updates old;
per step the trainer takes its batch from the replay buffer, trains exactly as the sync loop does,
and refits generation (waiting for the batch in flight, or in flight). See docs/guides/async-grpo.md.

Both share one outer loop (:func:`run_training`): validation, logging, checkpoints, the non-finite
guard; they differ only in their :class:`SyncSteps` / :class:`AsyncSteps` object.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from nemo_like.algorithms.advantages import advantage_metrics, compute_advantages, reward_group_metrics
from nemo_like.algorithms.checkpointing import checkpoint_manager, load_checkpoint_file, restore_run, save_run
from nemo_like.algorithms.distillation import (
    apply_distillation,
    gather_teacher_pass,
    start_teacher_pass,
    teacher_token_counts,
    weigh_task_advantages,
)
from nemo_like.algorithms.dynamic_sampling import (
    DynamicSamplingAccumulator,
    DynamicSamplingExhausted,
    apply_overlong_reward_shaping,
    select_groups_with_signal,
)
from nemo_like.algorithms.metrics import empty_extremes_as_nan
from nemo_like.algorithms.pass_at_k import correct_counts, mean_pass_at_k
from nemo_like.algorithms.rejection import apply_driver_masks
from nemo_like.algorithms.roles import scorer_specs
from nemo_like.algorithms.sample_reports import dump_train_samples, report_val_samples
from nemo_like.algorithms.setup import GRPOComponents
from nemo_like.config.schema import MasterConfig
from nemo_like.data.collate import collate_samples
from nemo_like.data.prompts import DataExhausted
from nemo_like.distributed import supervision
from nemo_like.environments.interface import CORRECT_REWARD
from nemo_like.experience.agent_rollouts import per_session
from nemo_like.experience.async_rollouts import BUFFER_FILE, AsyncRollouts, RefitTiming, TakenRollout
from nemo_like.experience.multi_turn import multi_turn_metrics
from nemo_like.experience.rollouts import (
    Rollout,
    add_batch_counters,
    collect_rollout,
    env_metrics_with_means,
    task_reward_metrics,
)
from nemo_like.experience.trajectory_collector import GenerationStats
from nemo_like.models.footprint import planned_memory_lines
from nemo_like.models.generation.interface import sampling_params
from nemo_like.models.loading import resolve_model_path
from nemo_like.models.policy.policy import TrainResult
from nemo_like.utils.checkpoint import VALIDATED_AT_STEP, CheckpointError, CheckpointInfo, CheckpointManager
from nemo_like.utils.flops import REFERENCE_TOKENS, flops_metrics, flops_spec
from nemo_like.utils.logger import Logger
from nemo_like.utils.seeds import rollout_seed, validation_seed
from nemo_like.utils.throughput import STEP_PHASES, TIMED_PHASES, TRAINED_TOKENS, throughput_metrics
from nemo_like.utils.timer import StepTimer


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps had a NaN/inf loss or gradient norm."""


def refit_if_stale(parts: GRPOComponents) -> float:
    """Push the policy's weights to generation when they changed; returns the seconds spent.

    Generation gets the policy's exporter, not an export: only a transport that reads the exported buckets calls
    it (the GPU transports read policy rank 0's tensors), so nothing is gathered to CPU, and no
    ``performance/refit_bytes`` counted, where nothing uses it. A colocated engine is about to wake on policy rank
    0's GPU: the policy first releases the memory training left behind (gradients, cached blocks)."""
    if parts.generation.weight_version == parts.policy.weight_version:
        return 0.0
    start = time.perf_counter()
    if getattr(parts.generation, "colocated", False):
        parts.policy.release_memory()
    parts.generation.refit(parts.policy.weight_buckets, parts.policy.weight_version)
    return time.perf_counter() - start


def validate(parts: GRPOComponents, step: int) -> dict[str, float]:
    """Accuracy on the held-out prompts (``grpo.val_num_generations_per_prompt`` responses each, decoded as
    configured); with several responses per prompt also ``validation/pass@k`` (unbiased estimator). Agent tasks count
    sessions, not rows (:func:`validation_metrics`)."""
    cfg = parts.cfg
    n = cfg.grpo.val_num_generations_per_prompt
    params = sampling_params(cfg, greedy=cfg.grpo.val_greedy)
    rollout = collect_rollout(
        parts.generation,
        parts.environment,
        parts.tokenizer,
        parts.val_prompts,
        n,
        params,
        seed=validation_seed(step),
        multi_turn=parts.plan.multi_turn,
    )
    report_val_samples(parts, step, rollout)
    metrics = validation_metrics(rollout, parts.environment.tasks, cfg.grpo.resolved_val_pass_k if n > 1 else [])
    metrics.update({f"validation/{k}": v for k, v in env_metrics_with_means(rollout.env_metrics).items()})
    if parts.plan.multi_turn is not None:
        metrics.update(multi_turn_metrics(rollout.samples, rollout.rewards, "validation/multi_turn", rollout.session_of_row))
    return metrics


def validation_metrics(rollout: Rollout, tasks: list[str], pass_k: list[int]) -> dict[str, float]:
    """A validation rollout's scores: ``validation/accuracy``, ``/reward``, ``/num_samples``, ``/pass@k`` (each k of
    ``pass_k``; none when empty) and ``validation/env/<task>/reward`` and ``/num_samples``, over its samples; and
    ``validation/mean_response_length`` (:func:`sample_response_lengths`). A sample is a row, except in agent and
    multi-turn tasks (``rollout.session_of_row`` set), where it is a session (an episode): a session that branched into
    several rows (each with the session's reward) counts once, by its first row, and ``validation/num_rows`` counts the
    rows."""
    prompts, rewards, groups = rollout.prompts, rollout.rewards, rollout.group_ids
    if rollout.session_of_row is not None:
        first, _ = per_session(rollout.session_of_row)
        prompts, rewards, groups = [prompts[i] for i in first.tolist()], rewards[first], groups[first]
    correct = (rewards >= CORRECT_REWARD).float()
    metrics = {
        "validation/accuracy": correct.mean().item(),
        "validation/reward": rewards.mean().item(),
        "validation/num_samples": float(len(rewards)),
        "validation/mean_response_length": sample_response_lengths(rollout).mean().item(),
    }
    if rollout.session_of_row is not None:
        metrics["validation/num_rows"] = float(len(rollout.samples))
    if pass_k:
        metrics.update({f"validation/pass@{k}": value for k, value in mean_pass_at_k(correct_counts(correct, groups), pass_k).items()})
    metrics.update(task_reward_metrics(prompts, rewards, tasks, prefix="validation/env"))
    return metrics


def session_values(rollout: Rollout, values: torch.Tensor) -> torch.Tensor:
    """``values`` ([B], one per row) one per sample: per row, or in agent tasks per session (a branched session's rows
    share one value; its first row's is taken)."""
    if rollout.session_of_row is None:
        return values
    return values[per_session(rollout.session_of_row)[0]]


def session_rewards(rollout: Rollout) -> torch.Tensor:
    """The task rewards one per sample: per row, or agent tasks per session (a branched session's rows share one)."""
    return session_values(rollout, rollout.raw_rewards)


def training_reward_metrics(rollout: Rollout, tasks: list[str], shaped: bool = False) -> dict[str, float]:
    """``train/reward`` and ``env/<task>/reward`` and ``/num_samples``, over the same samples (:func:`session_rewards`:
    a branched agent session counts once, as in validation; per row a 3-row session weighed three times); ``shaped``
    (``grpo.reward_shaping.enabled``): ``train/shaped_reward`` too, the mean of the shaped rewards the advantages used,
    over the same samples."""
    prompts = rollout.prompts
    if rollout.session_of_row is not None:
        prompts = [prompts[i] for i in per_session(rollout.session_of_row)[0].tolist()]
    rewards = session_rewards(rollout)
    metrics = {"train/reward": rewards.mean().item(), **task_reward_metrics(prompts, rewards, tasks)}
    if shaped:
        metrics["train/shaped_reward"] = session_values(rollout, rollout.rewards).mean().item()
    return metrics


def sample_response_lengths(rollout: Rollout) -> torch.Tensor:
    """Tokens the policy sampled per sample: per row, or in agent tasks per session, the sum over its rows (a branched
    session's rows hold disjoint sampled tokens; per row, its mean counted a 3-row session as three short samples)."""
    if rollout.session_of_row is None:
        return rollout.response_lengths
    first, row_index = per_session(rollout.session_of_row)
    return torch.zeros(len(first)).index_add_(0, row_index, rollout.response_lengths)


def session_truncated(rollout: Rollout) -> torch.Tensor:
    """1 per sample cut by its token budget: per row, or per session where one of its rows was (a branched multi-turn
    episode's earlier rows never are: per row, its rows diluted the fraction)."""
    if rollout.session_of_row is None:
        return rollout.truncated
    first, row_index = per_session(rollout.session_of_row)
    return torch.zeros(len(first)).scatter_reduce_(0, row_index, rollout.truncated, reduce="amax")


def shaping_lengths(rollout: Rollout) -> torch.Tensor:
    """Per row, the sampled length overlong shaping measures: the row's, or in agent tasks its session's (every row of
    a session takes its session's reward; a row's own length shaped a branched session by its first row alone)."""
    if rollout.session_of_row is None:
        return rollout.response_lengths
    return sample_response_lengths(rollout)[per_session(rollout.session_of_row)[1]]


def attach_advantages(cfg: MasterConfig, batch: dict[str, torch.Tensor], rollout: Rollout) -> dict[str, float]:
    """Per-token advantages of the collated ``batch`` from the rollout's rewards; returns the reward-group metrics (the
    advantage metrics come from :func:`trained_advantage_metrics`, once the teacher term and the driver's masks are in).
    Agent tasks: advantages are computed per session (a branched session weighs once in its group's baseline) and every
    row of a session takes its session's."""
    rewards, raw, groups, valid, row_index = rollout.rewards, rollout.raw_rewards, rollout.group_ids, batch["sample_mask"], None
    if rollout.session_of_row is not None:
        first, row_index = per_session(rollout.session_of_row)
        rewards, raw, groups, valid = rewards[first], raw[first], groups[first], valid[first]
    adv = compute_advantages(
        cfg.grpo.adv_estimator.name,
        rewards=rewards,
        prompt_ids=groups,
        valid_mask=valid,
        normalize_rewards=cfg.grpo.normalize_rewards,
        use_leave_one_out_baseline=cfg.grpo.use_leave_one_out_baseline,
        epsilon=cfg.grpo.advantage_std_epsilon,
    )
    per_row = adv.advantages if row_index is None else adv.advantages[row_index]
    batch["advantages"] = per_row.unsqueeze(-1) * batch["token_mask"]
    return reward_group_metrics(raw, groups, valid)  # per session too: a branched session is one sample of its group


def trained_advantage_metrics(batch: dict[str, torch.Tensor], task_advantages: torch.Tensor | None) -> dict[str, float]:
    """``advantages/*`` of what the loss uses: ``batch["advantages"]`` (the teacher's term and task weight in) over the
    tokens left to train on (after rollout rejection and the sequence masks). ``task_advantages``: with a teacher, the
    task reward's advantages before its weight and the teacher's term, logged as ``task_advantages/*`` over the same tokens."""
    trained = batch["token_mask"] * batch["sample_mask"].unsqueeze(-1)
    metrics = advantage_metrics(batch["advantages"], trained)
    if task_advantages is not None:
        metrics.update({f"task_{k}": v for k, v in advantage_metrics(task_advantages, trained).items()})
    return metrics


def shaped_rewards(cfg: MasterConfig, rewards: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """The rewards after DAPO overlong shaping (``grpo.reward_shaping``); unchanged when it is off."""
    shaping = cfg.grpo.reward_shaping
    if not shaping.enabled:
        return rewards
    return apply_overlong_reward_shaping(
        rewards,
        response_lengths,
        max_response_length=shaping.max_response_length or cfg.policy.generation.max_new_tokens,
        overlong_buffer_length=shaping.overlong_buffer_length,
        overlong_buffer_penalty=shaping.overlong_buffer_penalty,
    )


def filter_then_shape(
    cfg: MasterConfig, raw_rewards: torch.Tensor, response_lengths: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rewards to train on, keep mask)`` for one generation batch; the mask is ``None`` without dynamic sampling.

    DAPO order: groups are kept on the RAW task reward, then shaped. Filtering after shaping would keep a
    group whose responses all failed but differ in length, and the length penalty alone would then give
    it full-size (std-normalised) advantages.
    """
    keep = None
    if cfg.grpo.use_dynamic_sampling:
        keep = select_groups_with_signal(raw_rewards, group_ids, torch.ones_like(raw_rewards))
    return shaped_rewards(cfg, raw_rewards, response_lengths), keep


def collect_training_rollout(
    parts: GRPOComponents, step: int, timer: StepTimer, counts: dict[str, float] | None = None
) -> tuple[Rollout, dict[str, float]]:
    """One step's rollout; with dynamic sampling, keep generating until enough groups carry signal.
    ``counts['generated_tokens']`` adds up the response tokens of every generation batch."""
    cfg = parts.cfg
    params = sampling_params(cfg)
    accumulator = (
        DynamicSamplingAccumulator(cfg.grpo.num_prompts_per_step, cfg.grpo.dynamic_sampling_max_gen_batches)
        if cfg.grpo.use_dynamic_sampling
        else None
    )
    batch_index = 0
    env_counters: dict[str, float] = {}
    loader, at_start = parts.train_loader, parts.train_loader.state_dict()
    generated: list[tuple[torch.Tensor, torch.Tensor]] = []  # every generation batch's (task rewards, group ids)
    while True:
        if batch_index and loader.next_batch_epoch >= cfg.grpo.max_num_epochs:  # a refill must not start another epoch
            loader.load_state_dict(at_start)  # the step is not trained: a resume with more epochs draws its prompts again
            raise DataExhausted(
                f"grpo.max_num_epochs={cfg.grpo.max_num_epochs} reached while dynamic sampling refilled step {step} "
                f"({batch_index} generation batch(es) had too few groups with reward variance)"
            )
        phase_times: dict[str, float] = {}
        rollout = collect_rollout(
            parts.generation,
            parts.environment,
            parts.tokenizer,
            loader.next_batch(),
            cfg.grpo.num_generations_per_prompt,
            params,
            seed=rollout_seed(cfg.grpo.seed, step, batch_index),
            timings=phase_times,
            multi_turn=parts.plan.multi_turn,
            defer_scoring=parts.plan.overlap_scoring,  # the environments score while the logprob passes run
        )
        for name, seconds in phase_times.items():
            timer.add(name, seconds)
        if counts is not None:
            counts["generated_tokens"] = counts.get("generated_tokens", 0.0) + rollout.decoded_tokens
        if rollout.pending_scores is not None:
            return rollout, {}  # scored, and shaped, in train_on_rollout
        add_batch_counters(env_counters, rollout.env_metrics)
        # Group ids unique across generation batches, so groups from different batches never merge.
        group_ids = rollout.group_ids + batch_index * cfg.grpo.num_prompts_per_step
        shaped, keep = filter_then_shape(cfg, rollout.rewards, shaping_lengths(rollout), group_ids)
        rollout.set_shaped_rewards(shaped)
        if accumulator is None:
            return rollout, {}
        payload = {
            "prompts": rollout.prompts,
            "samples": rollout.samples,
            "texts": rollout.response_texts,
            "rewards": rollout.rewards,
            "task_rewards": rollout.task_rewards,
            "group_ids": group_ids,
        }
        if rollout.session_of_row is not None:  # sessions' rows: each batch's sessions numbered apart, as its groups are
            sessions_per_batch = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt  # ids 0.. of a batch
            payload["session_of_row"] = rollout.session_of_row + batch_index * sessions_per_batch
        try:
            accumulator.add(payload, keep, prompt_ids=group_ids)
        except DynamicSamplingExhausted as exc:  # the step it failed (the checkpoints before it are whole)
            rerun = (
                "The last checkpoint (if any was saved) is unaffected: a rerun with a higher limit resumes from it."
                if cfg.checkpointing.enabled
                else "Checkpointing is off: a rerun starts from step 0."
            )
            raise DynamicSamplingExhausted(f"step {step}: {exc} {rerun}") from None
        generated.append((session_rewards(rollout), session_values(rollout, group_ids)))  # a branched session once
        batch_index += 1
        if accumulator.is_full:
            kept, metrics = accumulator.take()
            metrics.update(generated_group_metrics(generated))
            _, dense_ids = torch.unique_consecutive(kept["group_ids"], return_inverse=True)
            rollout = Rollout(
                kept["prompts"], dense_ids, kept["samples"], kept["texts"], kept["rewards"], env_counters,
                session_of_row=kept.get("session_of_row"), task_rewards=kept["task_rewards"],
            )  # fmt: skip
            return rollout, metrics


def generated_group_metrics(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """``dynamic_sampling/generated_*``: the reward and group saturation of every generation batch of a step, the
    discarded groups included (the trained groups all have reward variance, so their pct_0 / pct_1 are always 0)."""
    rewards = torch.cat([r for r, _ in batches])
    groups = reward_group_metrics(rewards, torch.cat([g for _, g in batches]), torch.ones_like(rewards))
    return {
        "dynamic_sampling/generated_reward": rewards.mean().item(),
        "dynamic_sampling/generated_frac_reward_zero_std": groups["frac_reward_zero_std"],
        "dynamic_sampling/generated_pct_0": groups["baseline_reward/pct_0"],
        "dynamic_sampling/generated_pct_1": groups["baseline_reward/pct_1"],
    }


def attach_precomputed_reference(batch: dict[str, torch.Tensor], rollout: Rollout) -> None:
    """Put the reference logprobs the async collector computed for this rollout into the batch. They came
    from the same samples collated in the same order, so the width must match the batch's."""
    lp = rollout.reference_logprobs
    if lp is None:
        return
    if lp.shape != batch["input_ids"].shape:
        raise ValueError(f"precomputed reference logprobs of shape {tuple(lp.shape)} for a batch of {tuple(batch['input_ids'].shape)}")
    batch["reference_policy_logprobs"] = lp


@dataclass
class LogprobPasses:
    """The prev, reference and teacher logprob passes in flight on their actors (``None``: not run this step)."""

    prev: Any
    reference: Any
    teacher: Any = None


def start_logprob_passes(parts: GRPOComponents, batch: dict[str, torch.Tensor], rollout: Rollout) -> LogprobPasses:
    """Start the planned prev and reference passes, concurrently on their own actors (the reference pass not when
    the batch already carries its result)."""
    prev = parts.policy.get_logprobs_async(batch) if parts.plan.logprobs.compute_prev else None
    need_reference = parts.plan.logprobs.compute_reference and "reference_policy_logprobs" not in batch
    reference = parts.reference.get_logprobs_async(batch) if need_reference else None
    tasks = [p.metadata.get("task_name", "") for p in rollout.prompts]
    teacher = start_teacher_pass(parts.teacher, batch, tasks) if parts.plan.logprobs.compute_teacher else None
    return LogprobPasses(prev, reference, teacher)


def gather_logprob_passes(parts: GRPOComponents, passes: LogprobPasses, batch: dict[str, torch.Tensor], timer: StepTimer) -> bool:
    """Put the passes' results into ``batch``; returns whether the reference pass ran. The passes run concurrently, so
    each is timed as the driver's wait for it after the previous one (prev, then reference, then teacher): a pass that
    finished while the driver waited for an earlier one adds nothing. The reward wait and the passes' times never count
    the same seconds, and the phase shares of a step add up to at most 1 (timing each from one start counted the
    overlap twice: shares summed to 1.05-1.07)."""
    start = time.perf_counter()

    def waited(phase: str) -> None:
        nonlocal start
        now = time.perf_counter()
        timer.add(phase, now - start)
        start = now

    if passes.prev is not None:
        batch["prev_logprobs"] = parts.policy.gather_logprobs(passes.prev, "prev logprobs")
        waited("prev_logprobs")
    if passes.reference is not None:
        batch["reference_policy_logprobs"] = parts.reference.gather_logprobs(passes.reference, "reference logprobs")
        waited("reference_logprobs")
    if passes.teacher is not None:
        batch.update(gather_teacher_pass(parts.teacher, passes.teacher))
        waited("teacher_logprobs")
    return passes.reference is not None


def train_on_rollout(parts: GRPOComponents, step: int, timer: StepTimer, rollout: Rollout) -> dict[str, Any]:
    """The planned logprob passes, advantages, one policy update; returns the step's training metrics. Scores still
    pending (``grpo.overlap_scoring``) are gathered while the passes run, then shaped."""
    cfg = parts.cfg
    batch = collate_samples(rollout.samples, parts.tokenizer.pad_token_id)
    attach_precomputed_reference(batch, rollout)
    passes = start_logprob_passes(parts, batch, rollout)
    if rollout.pending_scores is not None:
        timer.add("reward", rollout.finish_scoring())  # the wait not hidden behind the passes
        rollout.set_shaped_rewards(shaped_rewards(cfg, rollout.rewards, shaping_lengths(rollout)))
    adv_metrics = attach_advantages(cfg, batch, rollout)
    task_advantages = batch["advantages"] if cfg.teacher.enabled else None  # replaced, not changed, by the teacher's term
    ran_reference = gather_logprob_passes(parts, passes, batch, timer)
    # Asked only when this step ran the pass: in async runs the collector may be using the reference actor right now
    # (the async step reports the collector's count instead).
    reference_passes = parts.reference.take_logprob_passes() if ran_reference else 0
    if passes.teacher is not None:
        adv_metrics.update(apply_distillation(cfg, batch))
    elif cfg.teacher.enabled:  # advantage_weight 0: no teacher pass, the KL loss term beside the weighted task advantage
        weigh_task_advantages(cfg, batch)
    sampled_mask = batch["token_mask"]  # the driver's masks below replace it, leaving this one as sampled
    adv_metrics.update(apply_driver_masks(cfg, batch, rollout.raw_rewards))
    adv_metrics.update(trained_advantage_metrics(batch, task_advantages))
    with timer.phase("policy_training"):
        result = parts.policy.train(batch)
    if cfg.logger.dump_train_data:
        dump_train_samples(parts, step, rollout, batch, result.first_step_logprobs, sampled_mask)
    # distillation/kl_loss (the teacher KL term) keeps its own namespace, beside the other distillation/ metrics
    trained = empty_extremes_as_nan(result.metrics)
    metrics: dict[str, Any] = {(k if k.startswith("distillation/") else f"train/{k}"): v for k, v in trained.items()}
    metrics.update({k: adv_metrics.pop(k) for k in [k for k in adv_metrics if k.startswith("distillation/")]})
    batch_tokens = float(batch["attention_mask"].sum())
    metrics.update({f"train/{k}": v for k, v in adv_metrics.items()})
    metrics["train/mean_response_length"] = sample_response_lengths(rollout).mean().item()
    metrics["train/truncated_fraction"] = session_truncated(rollout).mean().item()
    metrics["performance/num_samples"] = float(len(rollout.samples))
    metrics["performance/num_batch_tokens"] = batch_tokens
    metrics.update(update_metrics(result, parts.policy.weight_version, parts.policy.trainable_params, parts.policy.total_params))
    metrics.setdefault("train/kl_penalty", 0.0)
    metrics.setdefault("train/loss", math.nan)  # no optimizer step ran: there was no loss to compute
    # train/shaped_reward: what the advantages used; train/reward stays the task's
    metrics.update(training_reward_metrics(rollout, parts.environment.tasks, cfg.grpo.reward_shaping.enabled))
    metrics.update(env_metrics_with_means(rollout.env_metrics))
    if cfg.grpo.max_rollout_turns > 1:
        metrics.update(multi_turn_metrics(rollout.samples, rollout.raw_rewards, session_of_row=rollout.session_of_row))
    # The policy reports its logprob passes since its previous update with the training result (no extra round trip).
    metrics["performance/forward_passes/prev_logprobs"] = float(result.logprob_passes_since_last_update)
    metrics["performance/forward_passes/reference_logprobs"] = float(reference_passes)
    if passes.teacher is not None:
        metrics.update(teacher_token_counts(list(parts.teacher.models), passes.teacher, batch["attention_mask"]))
    return metrics


def update_metrics(result: TrainResult, weight_version: int, trainable_params: int, total_params: int) -> dict[str, float]:
    """The metrics of one :meth:`Policy.train` call: the mean pre-clip gradient norm of its optimizer steps (NaN when
    none updated the weights: ``train/empty_steps_skipped``, ``train/nonfinite_steps_skipped``), the learning rate, the
    weights' version after it, the trainable parameters and their share, the tokens trained on and the forward tokens
    per trained token."""
    norms = result.grad_norms
    return {
        "train/grad_norm": sum(norms) / len(norms) if norms else math.nan,
        "train/lr": result.lr,
        "train/nonfinite_steps_skipped": float(result.nonfinite_steps_skipped),
        "train/empty_steps_skipped": float(result.empty_steps_skipped),
        "train/weight_version": float(weight_version),
        "train/trainable_params": float(trainable_params),
        "train/trainable_fraction": trainable_params / max(total_params, 1),
        TRAINED_TOKENS: float(result.trained_tokens),  # fewer when an optimizer step had no token to train on
        "performance/training_forward_tokens_per_token": result.forward_tokens / max(float(result.trained_tokens), 1.0),
    }


def grpo_step(parts: GRPOComponents, step: int, timer: StepTimer) -> dict[str, Any]:
    """One sync training step; returns its metrics (namespaced)."""
    timer.add("refit", refit_if_stale(parts))
    counts: dict[str, float] = {}
    rollout, sampling_metrics = collect_training_rollout(parts, step, timer, counts)
    metrics = train_on_rollout(parts, step, timer, rollout)
    metrics.update({f"train/{k}": v for k, v in sampling_metrics.items()})
    metrics["performance/num_generated_tokens"] = counts["generated_tokens"]
    return metrics


def trajectory_age_metrics(ages: list[int], max_age: int) -> dict[str, float]:
    """Mean and max age of the trained samples (in weight updates) and the fraction at each age 0..max_age."""
    histogram = Counter(ages)
    metrics = {
        "train/avg_trajectory_age": sum(ages) / len(ages),
        "train/max_trajectory_age": float(max(ages)),
    }
    metrics.update({f"train/trajectory_age_fraction/{age}": histogram.get(age, 0) / len(ages) for age in range(max_age + 1)})
    return metrics


def timed_refit(refit: RefitTiming, timer: StepTimer) -> dict[str, float]:
    """Put an async refit's seconds on the step's timer (the load, and the trainer's wait for the batch in flight before
    a waiting refit) and return its ``idle/*`` metrics."""
    timer.add("refit", refit.refit)
    timer.add("waiting_for_refit", refit.trainer_waiting_for_refit)
    return {
        "idle/trainer_waiting_for_refit": refit.trainer_waiting_for_refit,
        "idle/generation_paused_for_refit": refit.generation_paused_for_refit,
    }


GENERATION_WEIGHT_VERSION = "async/generation_weight_version"


def async_generation_metrics(taken: TakenRollout, generated: GenerationStats, generation_weight_version: int) -> dict[str, float]:
    """What an async step reports of the buffer it took from and the collector's work since the previous step."""
    seconds, samples = generated.generation_seconds, taken.rollout.samples
    return {
        "async/buffer_size": float(taken.buffer_size),
        GENERATION_WEIGHT_VERSION: float(generation_weight_version),
        "async/refitted_mid_sequence_fraction": sum(s.refitted_mid_sequence for s in samples) / len(samples),
        "async/generation_seconds": seconds,
        "async/reward_seconds": generated.reward_seconds,
        "async/reference_logprob_seconds": generated.reference_seconds,
        "async/generation_batches": float(generated.batches),
        "async/generation_tokens_per_sec": generated.generated_tokens / seconds if seconds else 0.0,
        "idle/trainer_waiting_for_data": taken.waited_s,
        "idle/generation_paused_for_checkpoint": generated.paused_for_checkpoint,
        "idle/generation_paused_for_validation": generated.paused_for_validation,
        "idle/generation_waiting_for_pacing": generated.waiting_for_pacing,
        "performance/num_generated_tokens": generated.generated_tokens,
    }


def async_grpo_step(parts: GRPOComponents, rollouts: AsyncRollouts, step: int, timer: StepTimer) -> dict[str, Any]:
    """One async training step: take the step's groups from the buffer, train, refit generation."""
    cfg = parts.cfg
    taken = rollouts.take(step, parts.policy.weight_version)
    timer.add("waiting_for_data", taken.waited_s)
    rollout = taken.rollout
    rollout.set_shaped_rewards(filter_then_shape(cfg, rollout.rewards, shaping_lengths(rollout), rollout.group_ids)[0])
    metrics = train_on_rollout(parts, step, timer, rollout)
    # Once every batch is generated, a refit feeds nothing but this step's validation (AsyncSteps.validate refits then)
    refit = rollouts.refit() if rollouts.needs_refit() else RefitTiming(0.0, 0.0, 0.0)
    metrics.update(timed_refit(refit, timer))
    generated = rollouts.generation_stats()
    metrics.update(trajectory_age_metrics(taken.ages, cfg.grpo.async_grpo.max_trajectory_age_steps))
    metrics.update(async_generation_metrics(taken, generated, parts.generation.weight_version))
    if rollout.reference_logprobs is not None:  # the collector ran the reference pass: its passes since the last step
        metrics["performance/forward_passes/reference_logprobs"] = generated.reference_passes
        # and the tokens they scored (the batches generated since the last step, not the one this step trained on)
        metrics[REFERENCE_TOKENS] = generated.reference_tokens
    return metrics


def validates_at(cfg: MasterConfig, step: int) -> bool:
    """Whether training step ``step`` ends with a validation pass (``grpo.val_period``, and ``grpo.val_at_end`` at the last)."""
    periodic = bool(cfg.grpo.val_period) and step % cfg.grpo.val_period == 0
    return periodic or (step == cfg.grpo.max_num_steps and cfg.grpo.val_at_end)


def validations_after(cfg: MasterConfig, step: int, last: int) -> int:
    """Validation passes the steps after ``step`` up to ``last`` (the run's last step) end with, as
    :func:`validates_at` decides them with ``last`` as the end (the progress line's ETA counts them)."""
    if step >= last:
        return 0
    period = cfg.grpo.val_period
    periodic = last // period - step // period if period else 0
    return periodic + int(cfg.grpo.val_at_end and not (period and last % period == 0))


class StepRunner(Protocol):
    """What differs between the sync and async loops."""

    def start(self, last_step: int, checkpoint: CheckpointInfo | None) -> None: ...
    def step(self, step: int, timer: StepTimer) -> dict[str, Any]: ...
    def validate(self, step: int, timer: StepTimer) -> dict[str, float]: ...
    def save(self, manager: CheckpointManager, step: int, metrics: dict[str, Any]) -> Path: ...
    def data_ends_after(self) -> bool: ...
    def close(self) -> None: ...


class SyncSteps:
    """Generate with the latest weights at the start of each step (every sample has age 0)."""

    def __init__(self, parts: GRPOComponents) -> None:
        self.parts = parts

    def start(self, last_step: int, checkpoint: CheckpointInfo | None) -> None:
        pass

    def step(self, step: int, timer: StepTimer) -> dict[str, Any]:
        if self.data_ends_after():
            raise DataExhausted(f"grpo.max_num_epochs={self.parts.cfg.grpo.max_num_epochs} reached")
        return grpo_step(self.parts, step, timer)

    def data_ends_after(self) -> bool:
        """Whether the next step has no batch to start with (``grpo.max_num_epochs``): the step just run was the last."""
        return self.parts.train_loader.next_batch_epoch >= self.parts.cfg.grpo.max_num_epochs

    def validate(self, step: int, timer: StepTimer) -> dict[str, float]:
        timer.add("refit", refit_if_stale(self.parts))
        with timer.phase("validation"):
            return validate(self.parts, step)

    def save(self, manager: CheckpointManager, step: int, metrics: dict[str, Any]) -> Path:
        return save_run(self.parts, manager, step, metrics)

    def close(self) -> None:
        pass


def restored_async_state(checkpoint: CheckpointInfo) -> dict[str, Any]:
    """The replay buffer, pacing target and collector's unreported counters an async checkpoint holds
    (:class:`CheckpointError` naming the file if it lacks the buffer: its data position is ahead of training by the
    buffered batches, which would be skipped)."""
    buffer = load_checkpoint_file(checkpoint, BUFFER_FILE)
    if buffer is None:
        raise CheckpointError(
            f"Checkpoint {checkpoint.path} has no {BUFFER_FILE}: an async run resumes its replay buffer from it "
            "(without it the batches generated ahead of training would be skipped). Resume from a complete checkpoint."
        )
    saved = checkpoint.state["async"]
    # Checkpoints before the unreported counters were saved resume without them (those batches' counters unreported).
    return {"buffer": buffer, "next_target": saved["next_target"], "unreported_generation": saved.get("unreported_generation")}


class AsyncSteps:
    """Train on what the trajectory collector generated ahead (see :mod:`nemo_like.experience.async_rollouts`)."""

    def __init__(self, parts: GRPOComponents) -> None:
        self.parts = parts
        self.rollouts: AsyncRollouts | None = None

    def start(self, last_step: int, checkpoint: CheckpointInfo | None) -> None:
        restored = restored_async_state(checkpoint) if checkpoint is not None else None
        refit_if_stale(self.parts)  # after a resume, generation must start from the restored weights
        self.rollouts = AsyncRollouts(self.parts, last_step, restored)

    def step(self, step: int, timer: StepTimer) -> dict[str, Any]:
        return async_grpo_step(self.parts, self.rollouts, step, timer)

    def validate(self, step: int, timer: StepTimer) -> dict[str, float]:
        # The collector is held between batches while validation runs: a validation call queued behind its batch on the
        # one-call-at-a-time engine counted that wait against cluster.fault_tolerance.call_timeout_s (a healthy engine
        # was killed as hung). The wait for the batch in flight is the validation's. Generation has the latest weights
        # (refitted after training) unless every batch was generated already, when the step skipped its refit. Step 0's
        # validation comes before the collector starts (nothing to hold, the weights the same).
        held = contextlib.nullcontext(0.0) if self.rollouts is None else self.rollouts.paused("validation", until_pushed=False)
        with held as waited:
            timer.add("validation", waited)
            refitted = {}
            if self.parts.generation.weight_version != self.parts.policy.weight_version:
                refitted = timed_refit(self.rollouts.refit(), timer)
                # the step's record counts this refit (timing, bytes): its generation version says so too
                refitted[GENERATION_WEIGHT_VERSION] = float(self.parts.generation.weight_version)
            with timer.phase("validation"):
                return {**validate(self.parts, step), **refitted}

    def save(self, manager: CheckpointManager, step: int, metrics: dict[str, Any]) -> Path:
        with self.rollouts.paused("checkpoint"):  # nothing half generated: buffer + data position are exact
            loader_state, state, buffer = self.rollouts.checkpoint_state()
            return save_run(self.parts, manager, step, metrics, loader_state, state, {BUFFER_FILE: buffer})

    def data_ends_after(self) -> bool:
        """Not known ahead: the collector reads the data ahead of training; the next take says so (DataExhausted)."""
        return False

    def close(self) -> None:
        if self.rollouts is not None:
            self.rollouts.shutdown()


def grpo_train(parts: GRPOComponents, logger: Logger, resume_from: CheckpointInfo | None = None) -> list[dict[str, Any]]:
    """The sync loop: run steps up to ``grpo.max_num_steps`` (after ``resume_from``'s step, if given) with
    validation and checkpoints; returns the per-step metric records of this invocation."""
    return run_training(parts, logger, resume_from, SyncSteps(parts))


def async_grpo_train(parts: GRPOComponents, logger: Logger, resume_from: CheckpointInfo | None = None) -> list[dict[str, Any]]:
    """The async loop (``grpo.async_grpo.enabled``): generation runs ahead of training with bounded,
    versioned staleness; same arguments, records and checkpoints (plus the replay buffer) as :func:`grpo_train`."""
    return run_training(parts, logger, resume_from, AsyncSteps(parts))


def run_training(parts: GRPOComponents, logger: Logger, resume_from: CheckpointInfo | None, runner: StepRunner) -> list[dict[str, Any]]:
    """The outer loop shared by both modes: resume, validate, step, log, guard, checkpoint; a stop request (SIGTERM,
    SIGINT, ``checkpointing.save_before``) saves after the current step and raises ``RunInterrupted``."""
    from nemo_like.utils.run_control import RunInterrupted, run_control

    cfg, control = parts.cfg, run_control()
    faults = supervision.ledger()  # dead generation/environment actors: budgets and counters of the whole run (train.py)
    history: list[dict[str, Any]] = []
    for line in [*parts.plan.lines(), *planned_memory_lines(cfg, parts.plan, scorer_specs(cfg))]:  # the lines `nemo-like plan` prints
        logger.progress.message(f"[plan] {line}")
    teachers = cfg.teacher.models() if parts.plan.logprobs.compute_teacher or cfg.distillation.kl_weight > 0 else []
    lora = parts.policy.trainable_params if cfg.policy.lora_cfg.enabled else None  # the adapters: LoRA trains only them
    flops = flops_spec(cfg, resolve_model_path(cfg.policy.model_name), parts.plan, [resolve_model_path(m) for m in teachers], lora)
    logger.progress.message(f"[plan] {flops.describe()}")
    # grpo.max_num_epochs may end the run first: the count and ETA said 4/100 (an upper bound with dynamic sampling,
    # whose refills take batches of their own)
    logger.progress.set_total(min(cfg.grpo.max_num_steps, parts.train_loader.batches_in(cfg.grpo.max_num_epochs)))
    manager = checkpoint_manager(parts)
    last_step = restore_run(parts, resume_from) if resume_from is not None else 0

    def validate_at(step: int, timer: StepTimer) -> dict[str, float]:
        """The runner's validation pass, announced on the console first (it may run for minutes between two lines)."""
        with logger.progress.during(validation_start_line(step, len(parts.val_prompts), cfg.grpo.val_num_generations_per_prompt)):
            return runner.validate(step, timer)

    # The latest validation/* values, saved with each checkpoint until the next validation (best-k ranks by them).
    last_validation: dict[str, Any] = validation_of(resume_from.state.get("metrics", {})) if last_step else {}
    if (stop := control.requested) is not None:  # asked while the actors started: not after step 0's validation (minutes)
        raise RunInterrupted(stop, last_step, str(resume_from.path) if last_step else None)
    if last_step:
        logger.progress.message(f"[checkpoint] resumed from {resume_from.path} (step {last_step})")
    elif cfg.grpo.val_at_start:
        started = time.perf_counter()
        val = validate_at(0, StepTimer())
        control.validation_finished(time.perf_counter() - started)
        history.append(logger.log(val, step=0))
        logger.progress.message(validation_line(0, val))
    timer = StepTimer()
    # Carried in the checkpoints' metrics: a resumed (or requeued) run stops where the uninterrupted one would.
    nonfinite_streak = int(resume_from.state.get("metrics", {}).get(NONFINITE_STREAK, 0)) if last_step else 0
    saved_step = last_step

    def finish_run(final: int, saved_step: int, last_validation: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """End the run at step ``final`` (the data ran out, or a resume at its last step): its end-of-run validation if it
        lacks one, and a save of what the last checkpoint lacks; returns ``(saved_step, last_validation)``."""
        ran_here = final > last_step  # else: resumed from the last step's checkpoint (a stop or a requeue there)
        if ran_here:
            already = bool(validation_of(history[-1]))
        else:  # the checkpoint says whether its step was validated (it had ended no run, so maybe not)
            already = last_validation.get(VALIDATED_AT_STEP) == float(final)
        validated = False
        if cfg.grpo.val_at_end and final >= 1 and not already:
            # A validation-only record of the last step, as step 0's is (its refit's seconds belong to no step)
            val = validation_of(validate_at(final, StepTimer()))
            record = logger.log(val, final)
            if ran_here:  # a new dict: the step's record is the logger's too, which keeps what was logged
                history[-1] = {**history[-1], **val}
            else:
                history.append(record)
            last_validation = validation_of(val, final)
            logger.progress.message(validation_line(final, val))
            validated = True
        # The steps since the last save would be lost; a step saved before its end-of-run validation is saved
        # again with it (best-k retention and a resume read the checkpoint's validation)
        if manager is not None and (saved_step < final or validated):
            if ran_here:
                last_metrics = {k: v for k, v in history[-1].items() if k != "step"}
            else:  # the resumed checkpoint's own step metrics, with the validation it lacked
                last_metrics = dict(resume_from.state.get("metrics", {}))
            path = runner.save(manager, final, {**last_metrics, **last_validation})
            logger.progress.message(f"[checkpoint] saved {path}")
            saved_step = final
        return saved_step, last_validation

    runner.start(last_step, resume_from)
    try:
        # Asked before this attempt's first step (set-up, step 0's validation, the runner's start): none ran, none is saved
        if (stop := control.requested) is not None:
            raise RunInterrupted(stop, last_step, str(resume_from.path) if last_step else None)
        if last_step and last_step == cfg.grpo.max_num_steps:  # resumed at the last step: its validation may be left
            finish_run(last_step, saved_step, last_validation)
        for step in range(last_step + 1, cfg.grpo.max_num_steps + 1):
            timer.reset()
            start = time.perf_counter()
            control.step_started(step)
            try:
                metrics = runner.step(step, timer)
            except DataExhausted as exc:
                logger.progress.message(f"[done] {exc}")
                saved_step, last_validation = finish_run(step - 1, saved_step, last_validation)  # grpo.max_num_epochs ended it
                break
            # The last step: grpo.max_num_steps, or (sync) the data has no batch for another: it validates and saves once
            # (found at the next step instead, the run logged a second record of it and saved it twice)
            last = step == cfg.grpo.max_num_steps or runner.data_ends_after()
            if validates_at(cfg, step) or (last and cfg.grpo.val_at_end):
                metrics.update(validate_at(step, timer))
                last_validation = validation_of(metrics, step)
            nonfinite_streak = nonfinite_streak + 1 if metrics["train/nonfinite_steps_skipped"] else 0
            if metrics.get("train/empty_steps_skipped"):
                logger.progress.message(
                    f"[step {step}] {metrics['train/empty_steps_skipped']:.0f} optimizer step(s) had no token left to train on "
                    "(every row masked: grpo.rollout_rejection, grpo.seq_logprob_error_threshold, or rows with no token to "
                    "train such as failed agent sessions): skipped, no update"
                )
            metrics[NONFINITE_STREAK] = float(nonfinite_streak)
            total = time.perf_counter() - start
            # Taken after the step's validation, whose refit is timed in this step: its bytes belong to this record too.
            metrics["performance/refit_bytes"] = float(parts.policy.take_refit_bytes())
            metrics.update(faults.metrics())  # faults/*: only once an actor has died
            for phase in (*TIMED_PHASES, "validation", *timer.seconds):
                metrics[f"timing/train/{phase}"] = timer.seconds.get(phase, 0.0)
            metrics["timing/train/total_step_time"] = total
            metrics.update(throughput_metrics(metrics))
            metrics.update(flops_metrics(metrics, flops))
            history.append(logger.log(metrics, step))  # one record, shared with the logger's (a restart keeps those)
            validated = metrics["timing/train/validation"]
            logger.progress.update(step, progress_info(metrics), validated, validations_after(cfg, step, logger.progress.total))
            if cfg.logger.console_timing_period and step % cfg.logger.console_timing_period == 0:
                logger.progress.message(format_timing(metrics))
            if nonfinite_streak >= cfg.grpo.max_consecutive_nonfinite_steps:
                raise NonFiniteTrainingError(
                    f"{nonfinite_streak} consecutive steps had a non-finite loss or gradient norm (their updates were skipped); "
                    f"stopping at step {step} (grpo.max_consecutive_nonfinite_steps={cfg.grpo.max_consecutive_nonfinite_steps}). "
                    "Lower policy.optimizer.lr or check the rewards and the data."
                )
            control.step_finished(timer.seconds.get("validation", 0.0))
            saves = manager is not None and (step % cfg.checkpointing.save_period == 0 or last or control.wants_save())
            stop, path = control.stop_reason(validates_next=validates_at(cfg, step + 1), saves_first=saves), None
            # Log first, then save: a crash in between only repeats this step's log line on resume.
            if manager is not None and (saves or stop is not None):
                path = runner.save(manager, step, {**last_validation, **metrics})
                saved_step = step
                control.save_finished()
                logger.progress.message(f"[checkpoint] saved {path}")
                if stop is None:  # a signal during the save: this checkpoint is of the last step, stop without another
                    stop = control.requested
            if stop is not None and not last:
                raise RunInterrupted(stop, step, None if path is None else str(path))
            if stop is not None:  # the run is complete: nothing to resume or requeue, so it ends as any finished run
                logger.progress.message(
                    f"[stop] {stop.what}: asked during the last step, which completed the run: exiting with status 0, not "
                    f"{stop.status} (nothing to resume)"
                )
    finally:
        runner.close()
    return history


#: Metric: consecutive steps up to this one whose update was skipped as non-finite (grpo.max_consecutive_nonfinite_steps
#: stops the run when it reaches that); saved with each checkpoint, so a resume continues the count.
NONFINITE_STREAK = "train/nonfinite_streak"


def validation_of(metrics: dict[str, Any], step: int | None = None) -> dict[str, Any]:
    """The ``validation/*`` values of ``metrics``, with the step they measured when given (a checkpoint's metrics
    already carry it)."""
    values = {k: v for k, v in metrics.items() if k.startswith("validation/")}
    return values if step is None else {**values, VALIDATED_AT_STEP: float(step)}


def progress_info(metrics: dict[str, Any]) -> str:
    """The step's part of the console progress line: its reward and loss, and its validation accuracy when it ran one."""
    info = f"reward={metrics['train/reward']:.3f} loss={metrics['train/loss']:.4f}"
    if "validation/accuracy" in metrics:
        info += f" val_acc={metrics['validation/accuracy']:.3f}"
    return info


def validation_start_line(step: int, num_prompts: int, responses_per_prompt: int) -> str:
    """The console line (or the bar's text) while step ``step``'s validation pass runs."""
    return f"[step {step}] validating: {num_prompts:,} prompts x {responses_per_prompt} responses"


def validation_line(step: int, val: dict[str, Any]) -> str:
    """The console line of a validation pass outside the steps' progress (at the start, at the end)."""
    return f"[step {step}] validation/accuracy={val['validation/accuracy']:.3f}"


def format_timing(metrics: dict[str, Any]) -> str:
    """One line: each phase's seconds and share of the step."""
    total = metrics["timing/train/total_step_time"] or 1e-9
    parts = [
        f"{phase} {metrics[f'timing/train/{phase}']:.2f}s ({100 * metrics[f'timing/train/{phase}'] / total:.0f}%)"
        for phase in STEP_PHASES
        if metrics.get(f"timing/train/{phase}", 0.0) > 0
    ]
    return f"[timing] step {total:.2f}s: " + ", ".join(parts)
