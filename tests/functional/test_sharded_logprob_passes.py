"""A logprob pass over tensor-parallel groups (``ShardedLogprobs``), on real Ray actors standing for the ranks."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from ray import cloudpickle

from nemo_like.models.policy.sharded_logprobs import ShardedLogprobs

pytestmark = pytest.mark.slow
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import the tests package


class Rank:
    """One rank of a policy group: returns its rows' logprobs as its rank number; ``failing`` raises instead."""

    def __init__(self, rank: int, failing: bool) -> None:
        self.rank, self.failing = rank, failing

    def get_logprobs(self, batch: dict, **kwargs) -> torch.Tensor:
        if self.failing:
            raise ValueError(f"rank {self.rank} ran out of memory")
        return torch.full(batch["input_ids"].shape, float(self.rank))


def test_every_tensor_parallel_rank_is_waited_for_and_its_error_raised(ray_cluster):
    """Only the first rank of each tensor-parallel group was waited for: an error on another rank was never seen,
    and its group's first rank would wait in a collective until the stall watchdog."""
    batch = {"input_ids": torch.zeros(5, 3, dtype=torch.long), "token_mask": torch.ones(5, 3)}
    ranks = [ray.remote(Rank).options(num_cpus=0.01).remote(r, failing=False) for r in range(4)]  # dp 2 x tp 2
    passes = ShardedLogprobs(tuple(ranks), dp_size=2, name="policy")
    rows = passes.gather(passes.start(batch), "logprobs")
    assert rows[:, 0].tolist() == [0, 0, 2, 2, 2]  # one block per data-parallel group, from its first rank, in row order
    ranks[1] = ray.remote(Rank).options(num_cpus=0.01).remote(1, failing=True)
    passes = ShardedLogprobs(tuple(ranks), dp_size=2, name="policy")
    with pytest.raises(ray.exceptions.RayTaskError, match="rank 1 ran out of memory"):
        passes.gather(passes.start(batch), "logprobs")
    for actor in ranks:
        ray.kill(actor)
