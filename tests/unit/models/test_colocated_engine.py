"""Where a colocated vLLM engine runs: policy rank 0's node and GPU (pure decisions), and a node-pinned actor group
on a real Ray cluster (pinning, and a kept pinned group reused only by a run pinned the same way)."""

from __future__ import annotations

import os
import sys

import pytest
import ray
from ray import cloudpickle
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from nemo_like.distributed.worker_group import RayWorkerGroup, Reinitializable, WorkerResources, actor_scheduling
from nemo_like.models.generation.vllm import ColocatedPlacement, check_colocated_device, colocated_placement

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import the tests package

RANK0 = {"node_id": "a1" * 28, "node_ip": "10.0.0.7", "gpu_ids": ["3"], "uuid": "GPU-0f3c"}


def test_a_colocated_engine_is_placed_on_policy_rank_0s_node_and_shown_its_first_gpu():
    placement = colocated_placement({**RANK0, "gpu_ids": [3, 5]})
    assert placement.node_id == RANK0["node_id"] and placement.uuid == "GPU-0f3c"
    assert placement.env == {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "3"}


def test_a_policy_rank_without_a_gpu_cannot_host_a_colocated_engine():
    with pytest.raises(ValueError, match="holds no GPU"):
        colocated_placement({**RANK0, "gpu_ids": []})


def test_the_engine_on_the_policys_gpu_passes_the_start_check():
    check_colocated_device(colocated_placement(RANK0), ["GPU-0f3c"])


def test_an_engine_on_another_gpu_fails_at_start_naming_both_gpus_and_the_node():
    with pytest.raises(RuntimeError) as failure:
        check_colocated_device(colocated_placement(RANK0), ["GPU-9999"])
    message = str(failure.value)
    assert "GPU-9999" in message and "GPU-0f3c" in message and "10.0.0.7" in message and RANK0["node_id"] in message


def test_a_policy_that_reports_no_cuda_device_fails_the_start_check():
    placement = ColocatedPlacement(node_id="n", node_ip="10.0.0.7", uuid=None, env={"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(RuntimeError, match="reports no CUDA device"):
        check_colocated_device(placement, ["GPU-0f3c"])


def test_a_pinned_actor_gets_node_affinity_that_is_not_soft_and_others_keep_their_bundle():
    pinned = actor_scheduling(None, 0, RANK0["node_id"])
    assert isinstance(pinned, NodeAffinitySchedulingStrategy) and pinned.node_id == RANK0["node_id"] and pinned.soft is False
    pg = PlacementGroup.empty()
    bundled = actor_scheduling(pg, 1, None)
    assert isinstance(bundled, PlacementGroupSchedulingStrategy) and bundled.placement_group_bundle_index == 1
    with pytest.raises(ValueError):
        actor_scheduling(None, 0, None)


class Where(Reinitializable):
    """A small reusable actor that says which process and Ray node it runs in."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank

    def where(self) -> tuple[int, str]:
        return os.getpid(), ray.get_runtime_context().get_node_id()


def test_a_node_pinned_group_runs_there_and_is_reused_by_a_group_pinned_there_not_by_an_unpinned_one(ray_cluster):
    node = ray.get_runtime_context().get_node_id()
    resources = WorkerResources(num_cpus=0.01)
    pinned = RayWorkerGroup("pinned_probe", Where, 1, resources, {}, node_id=node)
    pid, where = ray.get(pinned.workers[0].where.remote())
    assert where == node
    pinned.shutdown()  # the session keeps actors (reuse_actors): this one is idle now

    unpinned = RayWorkerGroup("pinned_probe", Where, 1, resources, {})  # same shape but placed by bundle: a new actor
    assert ray.get(unpinned.workers[0].where.remote())[0] != pid
    unpinned.kill()

    again = RayWorkerGroup("pinned_probe", Where, 1, resources, {}, node_id=node)  # pinned to the same node: reused
    assert ray.get(again.workers[0].where.remote()) == (pid, node)
    again.kill()  # no placement group to remove: the actors only
