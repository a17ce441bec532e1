"""One rollout: prompts -> G samples each -> rewards."""

from __future__ import annotations

from dataclasses import dataclass

import time

import torch

from nemo_like.data.prompts import PromptRecord
from nemo_like.distributed.worker_group import RayWorkerGroup, get_with_context
from nemo_like.models.generation.interface import GeneratedSample, GenerationInterface, SamplingParams


@dataclass
class Rollout:
    """Samples of one step, in prompt-major order (the G samples of a prompt are adjacent)."""

    prompts: list[PromptRecord]  # one entry per sample
    group_ids: torch.Tensor  # [B] index of the prompt within the step
    samples: list[GeneratedSample]
    response_texts: list[str]
    rewards: torch.Tensor  # [B]

    @property
    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([len(s.response_ids) for s in self.samples], dtype=torch.float32)

    @property
    def truncated(self) -> torch.Tensor:
        return torch.tensor([s.truncated for s in self.samples], dtype=torch.float32)


def rollout_seed(seed: int, step: int, batch_index: int = 0) -> int:
    """The sampling seed of a step's generation batch (the sync loop uses the same, so an async run
    with ``max_trajectory_age_steps: 0`` reproduces the sync run)."""
    return (seed * 1_000_003 + step) * 101 + batch_index


def score_with_environment(env: RayWorkerGroup, texts: list[str], prompts: list[PromptRecord]) -> torch.Tensor:
    """Shard responses over the environment actors and gather one reward per response."""
    n = len(env)
    per = -(-len(texts) // n)
    refs = [
        w.score.remote(texts[i * per : (i + 1) * per], [p.metadata for p in prompts[i * per : (i + 1) * per]])
        for i, w in enumerate(env.workers)
        if texts[i * per : (i + 1) * per]
    ]
    rewards = [r for shard in get_with_context(refs, "reward") for r in shard]
    return torch.tensor(rewards, dtype=torch.float32)


def generate_rollout(
    generation: GenerationInterface,
    tokenizer,
    prompts: list[PromptRecord],
    num_generations: int,
    params: SamplingParams,
    seed: int,
) -> tuple[list[PromptRecord], torch.Tensor, list[GeneratedSample], list[str]]:
    """Generate ``num_generations`` samples per prompt and decode them."""
    expanded = [p for p in prompts for _ in range(num_generations)]
    group_ids = torch.arange(len(prompts)).repeat_interleave(num_generations)
    samples = generation.generate([p.prompt_token_ids for p in expanded], params, seed)
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    return expanded, group_ids, samples, texts


def collect_rollout(
    generation: GenerationInterface,
    env: RayWorkerGroup,
    tokenizer,
    prompts: list[PromptRecord],
    num_generations: int,
    params: SamplingParams,
    seed: int,
    timings: dict[str, float] | None = None,
) -> Rollout:
    """Generate and score one step's samples; fills ``timings['generation'|'reward']`` if given."""
    t0 = time.perf_counter()
    expanded, group_ids, samples, texts = generate_rollout(generation, tokenizer, prompts, num_generations, params, seed)
    t1 = time.perf_counter()
    rewards = score_with_environment(env, texts, expanded)
    if timings is not None:
        timings["generation"] = t1 - t0
        timings["reward"] = time.perf_counter() - t1
    return Rollout(expanded, group_ids, samples, texts, rewards)

