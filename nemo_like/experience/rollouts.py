"""One rollout: prompts -> G samples each -> rewards."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_like.data.prompts import PromptRecord
from nemo_like.environments.registry import route_by_task
from nemo_like.environments.worker import EnvironmentHandles
from nemo_like.experience.env_calls import PendingEnvCalls, call_environments
from nemo_like.experience.multi_turn import apply_stop_strings, ray_stepper, run_multi_turn
from nemo_like.models.generation.interface import GeneratedSample, GenerationInterface, SamplingParams
from nemo_like.plan.multi_turn import MultiTurnSettings


@dataclass
class Rollout:
    """Samples of one step, in prompt-major order (the G samples of a prompt are adjacent)."""

    prompts: list[PromptRecord]  # one entry per sample
    group_ids: torch.Tensor  # [B] index of the prompt within the step
    samples: list[GeneratedSample]
    response_texts: list[str]
    rewards: torch.Tensor  # [B]
    env_metrics: dict[str, float] = field(default_factory=dict)  # environments' counters, env/<task>/<name>, summed
    reference_logprobs: torch.Tensor | None = None  # [B, S] of the collated samples, when computed ahead (async)
    pending_scores: PendingScores | None = None  # scoring requested, not yet gathered (``rewards`` are NaN until then)
    session_of_row: torch.Tensor | None = None  # [B] agent and multi-turn tasks: each row's session (a branched one has several)
    task_rewards: torch.Tensor | None = None  # [B] the environments' rewards once ``rewards`` are shaped (DAPO overlong)

    def set_shaped_rewards(self, shaped: torch.Tensor) -> None:
        """Replace ``rewards`` with their shaped values, keeping the environments' as ``task_rewards``."""
        self.task_rewards, self.rewards = self.rewards, shaped

    @property
    def raw_rewards(self) -> torch.Tensor:
        """The environments' rewards before any shaping: what ``train/reward``, the group and task metrics report
        (``rewards``, which the advantages use, may be shaped)."""
        return self.rewards if self.task_rewards is None else self.task_rewards

    def finish_scoring(self) -> float:
        """Gather the pending scores into ``rewards`` and ``env_metrics``; returns the seconds waited (0 if none were pending)."""
        if self.pending_scores is None:
            return 0.0
        start = time.perf_counter()
        scores = self.pending_scores.result()
        self.rewards = scores.rewards
        add_counters(self.env_metrics, scores.metrics)
        self.pending_scores = None
        return time.perf_counter() - start

    @property
    def response_lengths(self) -> torch.Tensor:
        """Tokens the policy sampled per sample (multi-turn: every turn's, observation tokens excluded)."""
        return torch.tensor([s.num_sampled_tokens for s in self.samples], dtype=torch.float32)

    @property
    def decoded_tokens(self) -> float:
        """Tokens the engines decoded for these samples: the sampled ones plus any a stop string cut (what generation
        cost: ``performance/num_generated_tokens``)."""
        return float(sum(s.num_decoded_tokens for s in self.samples))

    @property
    def truncated(self) -> torch.Tensor:
        return torch.tensor([s.truncated for s in self.samples], dtype=torch.float32)


@dataclass
class Scores:
    """One reward per response, and the environments' counters for this batch (``env/<task>/<name>``)."""

    rewards: torch.Tensor  # [B]
    metrics: dict[str, float]


@dataclass
class PendingScores:
    """Scoring requests in flight on the environment actors (:func:`request_scores`); :meth:`result` gathers them."""

    calls: PendingEnvCalls

    def result(self) -> Scores:
        """One reward per response, in response order, and the environments' counters summed per task."""
        rewards, metrics = self.calls.gather()
        return Scores(torch.tensor(rewards, dtype=torch.float32), metrics)


def request_scores(envs: EnvironmentHandles, texts: list[str], prompts: list[PromptRecord]) -> PendingScores:
    """Score each response with the environment of its task (:func:`~.env_calls.call_environments`, the path the
    multi-turn steps take too); returns without waiting for the rewards."""
    return PendingScores(call_environments(envs, "score", texts, [p.metadata for p in prompts], "reward"))


def score_with_environment(envs: EnvironmentHandles, texts: list[str], prompts: list[PromptRecord]) -> Scores:
    """:func:`request_scores`, then wait for one reward per response."""
    return request_scores(envs, texts, prompts).result()


def task_reward_metrics(prompts: list[PromptRecord], rewards: torch.Tensor, tasks: list[str], prefix: str = "env") -> dict[str, float]:
    """Per task: ``{prefix}/<task>/reward`` (mean) and ``{prefix}/<task>/num_samples`` over the given samples."""
    metrics = {}
    for task, rows in route_by_task([p.metadata for p in prompts], tasks).items():
        metrics[f"{prefix}/{task}/reward"] = rewards[rows].mean().item()
        metrics[f"{prefix}/{task}/num_samples"] = float(len(rows))
    return metrics


def env_metrics_with_means(counters: dict[str, float]) -> dict[str, float]:
    """``counters`` plus, for every ``<key>/reward_sum`` with a ``<key>/num_samples`` beside it, ``<key>/reward``: their
    ratio, the mean per sample (counters are sums over actors and batches, so a mean must be derived after summing)."""
    out = dict(counters)
    for key, total in counters.items():
        if key.endswith("/reward_sum"):
            count = counters.get(key[: -len("reward_sum")] + "num_samples")
            if count:
                out[key[: -len("_sum")]] = total / count
    return out


#: Agent counters that are a batch's means per session, and the count of the sessions each is a mean over: batches
#: added up weigh them by it (``rows_per_session`` is over the sessions with rows; a batch without that count: all).
PER_SESSION_COUNTERS = {"agent/rows_per_session": "agent/sessions_with_rows", "agent/calls_per_session": "agent/sessions"}


def add_batch_counters(total: dict[str, float], counters: dict[str, Any]) -> dict[str, float]:
    """:func:`add_counters` for a step's generation batches (dynamic sampling's refills): sums, except the per-session
    means, which average over every batch's sessions (a sum multiplied them by the number of batches)."""
    for key, count in PER_SESSION_COUNTERS.items():
        if key in counters:
            count = count if count in counters else "agent/sessions"
            before, added = total.get(count, 0.0), float(counters.get(count, 0.0))
            sessions = before + added
            total[key] = (total.get(key, 0.0) * before + float(counters[key]) * added) / sessions if sessions else 0.0
    return add_counters(total, {k: v for k, v in counters.items() if k not in PER_SESSION_COUNTERS})


def add_counters(total: dict[str, float], counters: dict[str, Any]) -> dict[str, float]:
    """``total`` += ``counters`` key by key (in place); returns ``total``."""
    for key, value in counters.items():
        total[key] = total.get(key, 0.0) + float(value)
    return total


def expand_groups(prompts: list[PromptRecord], num_generations: int) -> tuple[list[PromptRecord], torch.Tensor]:
    """Each prompt repeated ``num_generations`` times in a row (one group each), and every sample's group index."""
    expanded = [p for p in prompts for _ in range(num_generations)]
    return expanded, torch.arange(len(prompts)).repeat_interleave(num_generations)


def generate_rollout(
    generation: GenerationInterface,
    tokenizer,
    prompts: list[PromptRecord],
    num_generations: int,
    params: SamplingParams,
    seed: int,
) -> tuple[list[PromptRecord], torch.Tensor, list[GeneratedSample], list[str]]:
    """Generate ``num_generations`` samples per prompt and decode them."""
    expanded, group_ids = expand_groups(prompts, num_generations)
    samples = generation.generate([p.prompt_token_ids for p in expanded], params, seed)
    if params.stop_strings:
        # decoded after the prompt's last id: a SentencePiece response's first space counts (a stop string ' 7')
        samples = [apply_stop_strings(tokenizer, s, params.stop_strings, s.prompt_ids[-1:]) for s in samples]
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    return expanded, group_ids, samples, texts


def collect_rollout(
    generation: GenerationInterface,
    envs: EnvironmentHandles,
    tokenizer,
    prompts: list[PromptRecord],
    num_generations: int,
    params: SamplingParams,
    seed: int,
    timings: dict[str, float] | None = None,
    multi_turn: MultiTurnSettings | None = None,
    defer_scoring: bool = False,
) -> Rollout:
    """Generate and score one step's samples; fills ``timings['generation'|'reward']`` if given.
    With ``multi_turn`` settings each sample runs the turn loop of :mod:`nemo_like.experience.multi_turn`
    (its reward: the sum of its environment steps' rewards; ``reward`` timing: the environment steps).
    ``defer_scoring`` (single-turn): return once the scores are requested; the caller gathers them with
    :meth:`Rollout.finish_scoring` (and times that wait itself).
    Agent tasks (``envs.agents``, :mod:`nemo_like.experience.agent_rollouts`): each sample is a session of the user's
    agent against the run's rollout server, and the sessions' rows are the samples."""
    agents = getattr(envs, "agents", None)
    if agents is not None and agents.serves(prompts, envs.tasks):
        return agents.collect(envs, prompts, num_generations, seed, timings, greedy=params.greedy)
    if multi_turn is not None:
        return collect_multi_turn_rollout(generation, envs, tokenizer, prompts, num_generations, params, seed, timings, multi_turn)
    t0 = time.perf_counter()
    expanded, group_ids, samples, texts = generate_rollout(generation, tokenizer, prompts, num_generations, params, seed)
    t1 = time.perf_counter()
    pending = request_scores(envs, texts, expanded)
    unscored = torch.full((len(samples),), float("nan"))
    rollout = Rollout(expanded, group_ids, samples, texts, unscored, {}, pending_scores=pending)
    if timings is not None:
        timings["generation"] = t1 - t0
    if not defer_scoring:
        rollout.finish_scoring()
        if timings is not None:
            timings["reward"] = time.perf_counter() - t1
    return rollout


def collect_multi_turn_rollout(
    generation: GenerationInterface,
    envs: EnvironmentHandles,
    tokenizer,
    prompts: list[PromptRecord],
    num_generations: int,
    params: SamplingParams,
    seed: int,
    timings: dict[str, float] | None,
    settings: MultiTurnSettings,
) -> Rollout:
    """:func:`collect_rollout` for multi-turn runs: every sample runs its turns against its task's environment actors.
    Its rows are sessions' (``session_of_row``): a sample whose chat template rewrote its history has several rows."""
    expanded, group_ids = expand_groups(prompts, num_generations)
    result = run_multi_turn(generation, ray_stepper(envs), tokenizer, expanded, params, seed, settings)
    if timings is not None:
        timings["generation"] = result.generation_seconds
        timings["reward"] = result.env_seconds
    metrics = {**result.env_metrics, "multi_turn/env_seconds": result.env_seconds}
    owners = torch.tensor(result.session_of_row, dtype=torch.long)
    prompts_of_rows = [expanded[i] for i in result.session_of_row]
    return Rollout(prompts_of_rows, group_ids[owners], result.samples, result.texts, result.rewards, metrics, session_of_row=owners)
