"""A group pinned to a node (a colocated vLLM engine) fails within its placement timeout, as a placement group does."""

from __future__ import annotations

import sys
import time

import pytest
import ray
from ray import cloudpickle
from ray.util.placement_group import remove_placement_group

from nemo_like.distributed.worker_group import PlacementError, RayWorkerGroup, WorkerResources, reserve_bundles

pytestmark = pytest.mark.slow
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import the tests package


class Probe:
    def __init__(self, rank: int, world_size: int) -> None:
        pass

    def ping(self) -> int:
        return 1


def live_probes() -> int:
    table = ray._private.state.actors()
    return sum(1 for a in table.values() if a.get("ActorClassName") == "Probe" and a.get("State") != "DEAD")


def test_a_pinned_group_whose_node_has_no_free_resources_fails_within_its_placement_timeout(ray_cluster):
    """Ray kept the pinned actors pending while other groups held the node's CPUs, with no timeout: the cluster-wide
    capacity check had passed and setup waited forever on the engine's first call."""
    node = ray.get_runtime_context().get_node_id()
    whole_node = ray.cluster_resources()["CPU"]
    holder = reserve_bundles("holder", WorkerResources(num_cpus=1.0), 1, 30)  # one of the test node's CPUs
    try:
        start = time.monotonic()
        with pytest.raises(
            PlacementError,
            match=rf"Cannot place 'generation' on node {node} .*asked for 1 x \{{'CPU': {whole_node}\}}.*not granted within 3s.*available now",
        ):
            RayWorkerGroup("generation", Probe, 1, WorkerResources(num_cpus=whole_node), {}, placement_timeout_s=3, node_id=node)
        assert time.monotonic() - start < 15
        with pytest.raises(PlacementError, match=rf"Cannot place 'generation' on node {node} .*the node cannot run it.*in total"):
            RayWorkerGroup("generation", Probe, 1, WorkerResources(num_cpus=64.0), {}, placement_timeout_s=30, node_id=node)
        assert time.monotonic() - start < 45
    finally:
        remove_placement_group(holder)
    deadline = time.monotonic() + 10
    while live_probes() and time.monotonic() < deadline:  # the failed groups' actors were killed
        time.sleep(0.2)
    assert live_probes() == 0
    group = RayWorkerGroup("generation", Probe, 1, WorkerResources(num_cpus=1.0), {}, placement_timeout_s=30, node_id=node)
    try:
        assert ray.get(group.run_rank0("ping"), timeout=60) == 1  # with room on the node it starts as before
    finally:
        group.kill()


class HelperPlacer:
    """An actor that reserves a helper group from inside, as a judge's environment actor places its engines."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.helpers = reserve_bundles("helper", WorkerResources(num_cpus=0.5), 1, 20)


def groups_named(part: str) -> list[str]:
    return [i["name"] for i in ray.util.placement_group_table().values() if part in i["name"] and i["state"] != "REMOVED"]


def test_a_replaced_or_killed_actors_helper_groups_are_removed(ray_cluster):
    """Ray keeps a group an actor reserved until the job ends, not until the actor dies: a replaced judge environment's
    helper group held its bundles, the replacement could not place its own, and the run stopped."""
    from nemo_like.distributed.worker_group import release_idle_actors

    release_idle_actors()  # the session's kept groups: a placement inside an actor cannot evict them (as a run's set-up does)
    group = RayWorkerGroup("environment:j", HelperPlacer, 1, WorkerResources(num_cpus=0.5), {}, placement_timeout_s=20)
    try:
        group.wait_started()
        first = groups_named("helper-")
        assert len(first) == 1 and "@placed-by-" in first[0]
        group.replace(0)
        group.wait_started([0])  # the replacement placed its own helpers: the dead one's bundle was freed
        deadline = time.monotonic() + 10
        while first[0] in groups_named("helper-") and time.monotonic() < deadline:  # removal is asynchronous
            time.sleep(0.2)
        second = groups_named("helper-")
        assert len(second) == 1 and second != first, (first, second)
    finally:
        group.kill()
    deadline = time.monotonic() + 10
    while groups_named("helper-") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert groups_named("helper-") == []
