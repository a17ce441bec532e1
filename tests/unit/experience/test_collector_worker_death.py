"""A worker that dies under the async trajectory collector (its reference pass) restarts the run as in a sync run: the
collector kept only the error's text and the trainer got a WorkerFailure naming no role, so the run stopped."""

from __future__ import annotations

import pickle
from dataclasses import asdict

import pytest
import torch
from ray.exceptions import RayTaskError

from nemo_like.algorithms.restarts import dead_role
from nemo_like.data.prompts import PromptDataLoader, PromptRecord
from nemo_like.distributed.worker_group import WorkerFailure
from nemo_like.experience.async_rollouts import raise_dead_worker
from nemo_like.experience.rollouts import Rollout
from nemo_like.experience.trajectory_collector import CollectorSettings, TrajectoryCollector
from nemo_like.models.generation.interface import GeneratedSample, SamplingParams

IDS = {"policy": {"p0"}, "reference": {"r0"}}
# What the reference group's gather raises (get_with_context) when its actor died.
DEATH = WorkerFailure("Ray actor r0 died during 'reference: reference logprobs (trajectory collector)'", "reference", "r0")


class DyingReference:
    """Stands for the reference policy's worker group: its pass starts, and gathering it finds the actor dead."""

    def start(self, batch, **kwargs):
        return ["ref"]

    def gather(self, refs, what):
        raise DEATH


def test_a_reference_death_in_the_collector_reaches_the_trainer_as_that_roles_death() -> None:
    loader = PromptDataLoader([PromptRecord(str(i), [], [1, 2, 3 + i], {}) for i in range(4)], 2, seed=0)
    settings = CollectorSettings(
        sampling=asdict(SamplingParams(max_new_tokens=2)), num_generations=1, seed=0, max_age=1, last_step=5,
        next_target=1, max_num_epochs=10, generation_version=0, reference=DyingReference(), pad_token_id=0,
    )  # fmt: skip
    collector = TrajectoryCollector.__new__(TrajectoryCollector)  # the actor's class, run in this process
    collector._setup(None, None, None, None, loader, settings)
    sample = GeneratedSample([1, 2], [3], [-0.1], False, 0, 0)
    rollout = Rollout([PromptRecord("0", [], [1, 2], {})], torch.tensor([0]), [sample], ["x"], torch.ones(1), {})
    collector.pushing = 1
    with pytest.raises(WorkerFailure):
        collector._push(rollout, 1, ["ref"], 0.0, {"generation": 0.0, "reward": 0.0})  # the pusher thread's body
    with pytest.raises(WorkerFailure) as loop_error:
        collector._wait_for_next_target()  # the loop's next turn raises what the pusher met
    assert dead_role(loop_error.value, IDS) == "reference"
    # From the collector actor the error comes back inside a RayTaskError (pickled: role and id survive).
    with pytest.raises(WorkerFailure) as trainer_error:
        raise_dead_worker(RayTaskError("run", "traceback", pickle.loads(pickle.dumps(loop_error.value))))
    assert (trainer_error.value.role, trainer_error.value.actor_id) == ("reference", "r0")
    assert dead_role(trainer_error.value, IDS) == "reference"
    raise_dead_worker(RayTaskError("run", "traceback", ValueError("a bug, not a death")))  # returns: not a worker's death
