"""What a run writes about its samples: the validation and training sample dumps (``logger.dump_train_data``) and the
validation samples printed to the console (``logger.num_val_samples_to_print``); docs/guides/logging.md."""

from __future__ import annotations

import sys
from typing import Any

import torch

from nemo_like.algorithms.setup import GRPOComponents
from nemo_like.experience.rollouts import Rollout
from nemo_like.utils.sample_dump import dump_path, format_samples, per_sample_mean, response_token_values, write_sample_dump


def prompt_texts(parts: GRPOComponents, rollout: Rollout) -> list[str]:
    """The exact text each sample's prompt gave the model (chat template included)."""
    return parts.tokenizer.batch_decode([s.prompt_ids for s in rollout.samples], skip_special_tokens=False)


def report_val_samples(parts: GRPOComponents, step: int, rollout: Rollout) -> None:
    """Dump the validation samples (``logger.dump_train_data``) and print the first few (``num_val_samples_to_print``)."""
    log_cfg = parts.cfg.logger
    if not (log_cfg.dump_train_data or log_cfg.num_val_samples_to_print):
        return
    prompts = prompt_texts(parts, rollout)
    if log_cfg.dump_train_data:
        write_sample_dump(
            dump_path(log_cfg.log_dir, "val", step),
            step,
            {
                "prompt_id": [p.id for p in rollout.prompts],
                "prompt": prompts,
                **response_columns(parts, rollout),
                "reward": rollout.rewards,
                "truncated": [s.truncated for s in rollout.samples],
                "response_token_ids": [s.response_ids for s in rollout.samples],
                "generation_logprobs": [s.response_logprobs for s in rollout.samples],
                **turn_columns(rollout),
            },
        )
    if log_cfg.num_val_samples_to_print:
        text = format_samples(prompts, rollout.response_texts, rollout.rewards.tolist(), log_cfg.num_val_samples_to_print)
        print(f"[validation samples, step {step}]\n{text}", file=sys.stderr, flush=True)


def turn_columns(rollout: Rollout) -> dict[str, list]:
    """Multi-turn and agent dump columns (none for single-turn samples): each row's turn count, the per-token mask of its
    response (1 sampled, 0 observation) and its episode or session (``session``: a branched one has several rows); the
    turns as messages and the environment steps' metrics where
    the environment's turns made them (an agent's rows hold the tokens of its calls, not their messages)."""
    samples = rollout.samples
    if all(s.response_mask is None and s.messages is None for s in samples):
        return {}
    columns: dict[str, list] = {
        "num_turns": [s.num_turns for s in samples],
        "response_mask": [s.sampled_mask for s in samples],
        "length_truncated": [s.length_truncated for s in samples],
    }
    if rollout.session_of_row is not None:  # a branched episode's (an agent session's) rows share it
        columns["session"] = rollout.session_of_row.tolist()
    if any(s.messages is not None for s in samples):
        columns.update(turns=[s.messages for s in samples], step_metrics=[s.step_metrics for s in samples])
    return columns


def response_columns(parts: GRPOComponents, rollout: Rollout) -> dict[str, list]:
    """``response``, the decoded response; for agent tasks (whose scored text is the answer the agent returned, not the
    tokens sampled) the decoded tokens, and that answer as ``answer``."""
    if rollout.session_of_row is None or not parts.plan.agent_tasks:  # multi-turn rows have sessions too
        return {"response": rollout.response_texts}
    decoded = parts.tokenizer.batch_decode([s.response_ids for s in rollout.samples], skip_special_tokens=False)
    return {"response": decoded, "answer": rollout.response_texts}


def dump_train_samples(
    parts: GRPOComponents,
    step: int,
    rollout: Rollout,
    batch: dict[str, torch.Tensor],
    first_step_logprobs: torch.Tensor | None,
    sampled_mask: torch.Tensor,
) -> None:
    """Write ``train_data_step{step}.jsonl``. Without a prev pass, prev logprobs are back-filled from the
    training pass's pre-update logprobs (the prev pass is skipped only with one optimizer step per rollout).
    ``sampled_mask``: the sampled tokens, before the driver's masks (rollout rejection) took any out of training: the
    per-token columns hold a value for every sampled token, the rejected ones included (``trained_token_mask`` says
    which were trained on)."""
    mask = sampled_mask
    prev = batch.get("prev_logprobs")
    if prev is None and first_step_logprobs is not None and first_step_logprobs.shape == mask.shape:
        prev = first_step_logprobs
    columns: dict[str, Any] = {
        "prompt_id": [p.id for p in rollout.prompts],
        "group_id": rollout.group_ids,
        "prompt": prompt_texts(parts, rollout),
        **response_columns(parts, rollout),
        "reward": rollout.raw_rewards,  # the task's, as train/reward
        "shaped_reward": rollout.rewards,  # what the advantages used (equal unless grpo.reward_shaping)
        "advantage": per_sample_mean(batch["advantages"], mask),
        "token_advantages": response_token_values(batch["advantages"], mask),  # a teacher adds a per-token term
        "sample_mask": batch["sample_mask"],
        "truncated": [s.truncated for s in rollout.samples],
        "response_token_ids": [s.response_ids for s in rollout.samples],
        # which weights sampled each row (async runs: its age is the step's weight version minus this)
        "weight_version": [s.weight_version for s in rollout.samples],
        "final_weight_version": [s.final_weight_version for s in rollout.samples],
        # null where the engine does not record its in-flight refits per position (vLLM; multi-turn and agent rows)
        "weight_version_changes": [
            None if s.weight_version_changes is None else [list(c) for c in s.weight_version_changes] for s in rollout.samples
        ],
        "generation_logprobs": response_token_values(batch["generation_logprobs"], mask),
        "prev_logprobs": response_token_values(prev, mask) if prev is not None else [None] * len(rollout.samples),
        "trained_token_mask": response_token_values(batch["token_mask"].long(), mask),
        **turn_columns(rollout),
    }
    if "reference_policy_logprobs" in batch:
        columns["reference_logprobs"] = response_token_values(batch["reference_policy_logprobs"], mask)
    write_sample_dump(dump_path(parts.cfg.logger.log_dir, "train", step), step, columns)
