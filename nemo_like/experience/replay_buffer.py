"""Finished prompt groups waiting for the training step they were generated for.

Each :class:`TrajectoryGroup` is one prompt's G samples, scored, tagged with the target step the
pacer gave its batch and (per sample) the weight version that generated it. The buffer is FIFO by
target step, hands a step exactly the groups generated for it, never drops a finished group, and
refuses (loudly) to hand out a sample older than the bound: that would be a pacing bug.

:class:`ReplayBuffer` is plain Python (unit-tested directly); :class:`ReplayBufferActor` is the
thread-safe Ray actor around it, whose :meth:`~ReplayBufferActor.take` blocks until a step is ready.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from nemo_like.data.prompts import DataExhausted, PromptRecord
from nemo_like.distributed.reinit import Reinitializable
from nemo_like.models.generation.interface import GeneratedSample


class ReplayBufferError(RuntimeError):
    """A group would be dropped, handed out of order, or is older than the staleness bound."""


@dataclass
class TrajectoryGroup:
    """One prompt's samples, rewarded, generated for ``target_step``."""

    target_step: int
    prompt: PromptRecord
    samples: list[GeneratedSample]
    response_texts: list[str]
    rewards: list[float]
    # [G, S]: the reference policy's logprobs of these samples, rows of their batch collated whole (S: the batch's
    # width), when the collector computed them ahead; None: the trainer runs the reference pass.
    reference_logprobs: torch.Tensor | None = None
    # The counters of the batch the group was generated in (its environments' env/<task>/..., an agent batch's
    # agent/*), on the batch's first group only: the step that trains the batch reports them. A step takes exactly the
    # groups generated for it, so they describe the samples it trains.
    batch_metrics: dict[str, float] | None = None

    @property
    def generation_version(self) -> int:
        """The oldest weight version that produced any sample of the group."""
        return min(s.weight_version for s in self.samples)


def trajectory_ages(groups: list[TrajectoryGroup], trainer_version: int) -> list[int]:
    """Per sample: how many updates older its (starting) weights are than the weights being trained."""
    return [trainer_version - s.weight_version for g in groups for s in g.samples]


class ReplayBuffer:
    """FIFO of :class:`TrajectoryGroup` keyed by target step; ``groups_per_step`` groups make a step."""

    def __init__(self, groups_per_step: int, max_age: int) -> None:
        self.groups_per_step = groups_per_step
        self.max_age = max_age
        self.groups: list[TrajectoryGroup] = []
        self.last_taken_step = 0
        self.finished_reason: str | None = None

    def __len__(self) -> int:
        return len(self.groups)

    def push(self, groups: list[TrajectoryGroup]) -> None:
        """Append finished groups; target steps must not go backwards nor precede a step already taken."""
        for group in groups:
            newest = self.groups[-1].target_step if self.groups else self.last_taken_step
            if group.target_step < newest or group.target_step <= self.last_taken_step:
                raise ReplayBufferError(
                    f"group for step {group.target_step} pushed after step {newest} (last taken: {self.last_taken_step}): "
                    "the buffer is FIFO by target step"
                )
            self.groups.append(group)

    def ready(self, step: int) -> bool:
        """Whether every group of ``step`` has arrived."""
        return sum(g.target_step == step for g in self.groups) >= self.groups_per_step

    def take(self, step: int, trainer_version: int) -> list[TrajectoryGroup]:
        """Remove and return the groups of ``step`` in arrival order (call when :meth:`ready`)."""
        if any(g.target_step < step for g in self.groups):
            stale = sorted({g.target_step for g in self.groups if g.target_step < step})
            raise ReplayBufferError(f"step {step} requested while groups for earlier steps {stale} are unconsumed")
        batch = [g for g in self.groups if g.target_step == step]
        if len(batch) != self.groups_per_step:
            raise ReplayBufferError(f"step {step} has {len(batch)} groups, expected {self.groups_per_step}")
        ages = trajectory_ages(batch, trainer_version)
        if max(ages) > self.max_age or min(ages) < 0:
            raise ReplayBufferError(
                f"step {step} (trainer weights v{trainer_version}) got samples of ages {min(ages)}..{max(ages)}, "
                f"outside 0..{self.max_age} (grpo.async_grpo.max_trajectory_age_steps)"
            )
        self.groups = [g for g in self.groups if g.target_step != step]
        self.last_taken_step = step
        return batch

    def finish(self, reason: str) -> None:
        """No more groups will arrive (a step that is not ready then raises :class:`DataExhausted`)."""
        self.finished_reason = reason

    def state_dict(self) -> dict[str, Any]:
        return {"groups": list(self.groups), "last_taken_step": self.last_taken_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = list(state["groups"])
        self.last_taken_step = int(state["last_taken_step"])


class ReplayBufferActor(Reinitializable):
    """Thread-safe :class:`ReplayBuffer` for a threaded Ray actor (``max_concurrency > 1``): the
    trainer's :meth:`take` waits while the collector's :meth:`push` calls proceed. Kept between the runs of one driver
    (:func:`~nemo_like.distributed.worker_group.reuse_actors`): re-initialised empty."""

    def __init__(self, rank: int, world_size: int, groups_per_step: int, max_age: int) -> None:
        self.buffer = ReplayBuffer(groups_per_step, max_age)
        self.cond = threading.Condition()
        self.waiting_takes = 0  # a take the last run left waiting (released by its finish()): not re-initialised under it

    def busy_with(self) -> str | None:
        with self.cond:
            return "take" if self.waiting_takes else None

    def push(self, groups: list[TrajectoryGroup]) -> int:
        """Add groups; returns the buffer size."""
        with self.cond:
            self.buffer.push(groups)
            self.cond.notify_all()
            return len(self.buffer)

    def take(self, step: int, trainer_version: int) -> tuple[list[TrajectoryGroup], int]:
        """Wait until ``step`` is ready and take it: ``(groups, groups left in the buffer)``."""
        with self.cond:
            self.waiting_takes += 1
            try:
                self.cond.wait_for(lambda: self.buffer.ready(step) or self.buffer.finished_reason is not None)
            finally:
                self.waiting_takes -= 1
            if not self.buffer.ready(step):
                raise DataExhausted(f"no data for step {step}: {self.buffer.finished_reason}")
            return self.buffer.take(step, trainer_version), len(self.buffer)

    def finish(self, reason: str) -> None:
        with self.cond:
            self.buffer.finish(reason)
            self.cond.notify_all()

    def state_dict(self) -> dict[str, Any]:
        with self.cond:
            return self.buffer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.cond:
            self.buffer.load_state_dict(state)
