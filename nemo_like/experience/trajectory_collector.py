"""The trajectory collector: a Ray actor that keeps generating prompt batches while the policy trains.

Its :meth:`TrajectoryCollector.run` loop (the actor's long-running call) draws the next prompt batch,
asks the :class:`~nemo_like.experience.pacing.StalenessPacer` which training step will consume it,
generates and scores it on the generation and reward actors, and pushes its groups into the replay
buffer actor. Between batches it honours the driver's requests:

* ``pause(reason)`` returns once no batch is in flight (a refit that waits for in-flight requests,
  validation and checkpoints use it); ``resume(version)`` tells it the generation weights' version;
* ``set_generation_version(version)`` after an in-flight refit (generation never stopped);
* ``stop()`` ends the loop.

It is a threaded actor: those calls run while ``run`` is busy. It owns the training prompt loader,
so its position is the run's data position (saved in checkpoints while paused, when no batch is
half done).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import ray

from nemo_like.data.prompts import PromptDataLoader, PromptRecord
from nemo_like.environments.worker import EnvironmentHandles
from nemo_like.experience.multi_turn import MultiTurnSettings
from nemo_like.experience.pacing import StalenessPacer
from nemo_like.experience.replay_buffer import TrajectoryGroup
from nemo_like.experience.rollouts import Rollout, add_counters, collect_rollout, rollout_seed
from nemo_like.models.generation.interface import GeneratedSample, SamplingParams, generate_on_group
from nemo_like.models.loading import load_tokenizer


@dataclass
class GenerationStats:
    """What the collector did since the driver last asked (seconds, tokens, batches)."""

    generation_seconds: float = 0.0
    reward_seconds: float = 0.0
    generated_tokens: float = 0.0
    batches: int = 0
    waiting_for_pacing: float = 0.0  # held by the staleness bound
    paused_for_refit: float = 0.0
    paused_for_checkpoint: float = 0.0
    env_counters: dict[str, float] = field(default_factory=dict)  # env/<task>/<counter>

    def add_pause(self, reason: str, seconds: float) -> None:
        name = f"paused_for_{reason}"
        if hasattr(self, name):
            setattr(self, name, getattr(self, name) + seconds)


class ActorHandles:
    """Actor handles that quack like a :class:`~nemo_like.distributed.worker_group.RayWorkerGroup`
    (``workers``, ``len``) so the rollout helpers run unchanged inside another actor."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = list(workers)

    def __len__(self) -> int:
        return len(self.workers)

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[GeneratedSample]:
        return generate_on_group(self, prompts, params, seed)


def split_into_groups(rollout: Rollout, target_step: int) -> list[TrajectoryGroup]:
    """One :class:`TrajectoryGroup` per prompt of a prompt-major rollout."""
    groups: dict[int, list[int]] = defaultdict(list)
    for index, group_id in enumerate(rollout.group_ids.tolist()):
        groups[group_id].append(index)
    return [
        TrajectoryGroup(
            target_step=target_step,
            prompt=rollout.prompts[rows[0]],
            samples=[rollout.samples[i] for i in rows],
            response_texts=[rollout.response_texts[i] for i in rows],
            rewards=[float(rollout.rewards[i]) for i in rows],
        )
        for _, rows in sorted(groups.items())
    ]


class TrajectoryCollector:
    """See the module docstring. Construct through Ray with ``max_concurrency >= 3``."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        generation_workers: list[Any],
        environments: EnvironmentHandles,
        buffer: Any,
        tokenizer_name: str,
        records: list[PromptRecord],
        loader_args: dict[str, Any],
        loader_state: dict[str, int] | None,
        sampling: dict[str, Any],
        num_generations: int,
        seed: int,
        max_age: int,
        last_step: int,
        next_target: int,
        max_num_epochs: int,
        generation_version: int,
        multi_turn: MultiTurnSettings | None = None,
    ) -> None:
        self.generation = ActorHandles(generation_workers)
        self.environment = environments
        self.buffer = buffer
        self.tokenizer = load_tokenizer(tokenizer_name)
        self.loader = PromptDataLoader(records, **loader_args)
        if loader_state is not None:
            self.loader.load_state_dict(loader_state)
        self.params = SamplingParams(**sampling)
        self.num_generations = num_generations
        self.seed = seed
        self.pacer = StalenessPacer(max_age, last_step, next_target)
        self.max_num_epochs = max_num_epochs
        self.version = generation_version
        self.multi_turn = multi_turn  # every turn of a batch's samples runs inside the batch: a checkpoint never splits one
        self.cond = threading.Condition()
        self.pause_reasons: set[str] = set()
        self.paused = False
        self.in_flight = False
        self.stopping = False
        self.exhausted = False
        self.failure: str | None = None
        self.stats = GenerationStats()
        self._pause_started: dict[str, float] = {}

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Generate batches until :meth:`stop`; returns the final counters."""
        while True:
            target = self._wait_for_next_target()
            if target is None:
                return {"batches": self.stats.batches, "next_target": self.pacer.next_target}
            try:
                self._generate_batch(target)
            except BaseException as exc:
                with self.cond:
                    self.failure = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                with self.cond:
                    self.in_flight = False
                    self.cond.notify_all()

    def _wait_for_next_target(self) -> int | None:
        """Block until a batch may start (not paused, within the age bound); ``None`` once stopped."""
        with self.cond:
            while True:
                if self.stopping:
                    return None
                if self.pause_reasons:
                    if not self.paused:
                        self.paused = True
                        self.cond.notify_all()
                    self.cond.wait()
                    continue
                self.paused = False
                if not self.exhausted and not self.pacer.done and self.loader.epoch >= self.max_num_epochs:
                    self.exhausted = True
                    ray.get(self.buffer.finish.remote(f"grpo.max_num_epochs={self.max_num_epochs} reached"))
                target = None if self.exhausted else self.pacer.reserve(self.version)
                if target is not None:
                    self.in_flight = True
                    return target
                held_by_bound = not self.pacer.done and not self.exhausted  # else: nothing left to generate
                waited_from = time.perf_counter()
                self.cond.wait()
                if held_by_bound:
                    self.stats.waiting_for_pacing += time.perf_counter() - waited_from

    def _generate_batch(self, target: int) -> None:
        prompts = self.loader.next_batch()
        timings: dict[str, float] = {}
        rollout = collect_rollout(
            self.generation,
            self.environment,
            self.tokenizer,
            prompts,
            self.num_generations,
            self.params,
            seed=rollout_seed(self.seed, target),
            timings=timings,
            multi_turn=self.multi_turn,
        )
        ray.get(self.buffer.push.remote(split_into_groups(rollout, target)))
        with self.cond:
            self.stats.generation_seconds += timings["generation"]
            self.stats.reward_seconds += timings["reward"]
            self.stats.generated_tokens += float(rollout.response_lengths.sum())
            self.stats.batches += 1
            add_counters(self.stats.env_counters, rollout.env_metrics)  # env/<task>/<counter>

    # -- control (called by the driver while run() is busy) ---------------------------------------------
    def pause(self, reason: str) -> float:
        """Hold the loop between batches; returns the seconds spent waiting for the batch in flight."""
        start = time.perf_counter()
        with self.cond:
            self.pause_reasons.add(reason)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.failure is not None or (not self.in_flight and (self.paused or self.stopping)))
            if self.failure is not None:
                raise RuntimeError(f"the trajectory collector failed: {self.failure}")
            self._pause_started[reason] = time.perf_counter()
        return time.perf_counter() - start

    def resume(self, reason: str, generation_version: int | None = None) -> float:
        """Release a :meth:`pause`; returns the seconds generation was held for ``reason``."""
        with self.cond:
            held = time.perf_counter() - self._pause_started.pop(reason)
            self.stats.add_pause(reason, held)
            self.pause_reasons.discard(reason)
            if generation_version is not None:
                self.version = generation_version
            self.cond.notify_all()
            return held

    def set_generation_version(self, generation_version: int) -> None:
        """The generation weights changed without a pause (in-flight refit)."""
        with self.cond:
            self.version = generation_version
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    # -- reporting and state ----------------------------------------------------------------------------
    def take_stats(self) -> GenerationStats:
        """Counters accumulated since the last call, then reset."""
        with self.cond:
            stats, self.stats = self.stats, GenerationStats()
            return stats

    def state_dict(self) -> dict[str, Any]:
        """Loader position and next target; only meaningful while paused (no batch half done)."""
        with self.cond:
            if self.in_flight:
                raise RuntimeError("collector state requested while a batch is in flight; pause it first")
            return {"loader": self.loader.state_dict(), "pacer": self.pacer.state_dict()}
