"""The pre-launch checks that fractional GPU shares can be placed, and that a private cluster's GPUs are counted as
the cluster will get them (none with ``cluster.gpus_per_node=0``)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from nemo_like.algorithms import roles
from nemo_like.config import MasterConfig, load_config
from nemo_like.distributed import ray_init
from nemo_like.distributed.capacity import check_node_placement
from nemo_like.distributed.worker_group import PlacementError, RoleResources, WorkerResources
from nemo_like.plan.run_plan import RunPlan, decide_run_plan

RECIPES = Path(__file__).resolve().parents[3] / "examples" / "configs"


def share_roles(shares: list[float]) -> list[RoleResources]:
    """One role per share size, as many actors as that size appears (whole GPUs as ``policy``)."""
    return [
        RoleResources("policy" if g >= 1 else f"environment:rm{g:g}", shares.count(g), WorkerResources(num_cpus=0.1, num_gpus=g))
        for g in sorted(set(shares))
    ]


def placeable(shares: list[float], gpus: int) -> bool:
    """Whether ``shares`` fit on ``gpus`` GPUs as Ray grants them (a fraction out of one GPU, a whole GPU whole),
    by trying every assignment; in Ray's units of 1/10000."""
    whole = sum(int(g) for g in shares if g >= 1)
    if whole > gpus:
        return False
    return fits([round(g * 10_000) for g in shares if g < 1], [10_000] * (gpus - whole))


def fits(units: list[int], free: list[int]) -> bool:
    """Whether items of ``units`` fit in containers with ``free`` units left, by trying every assignment."""
    units = sorted(units, reverse=True)

    def fit(i: int) -> bool:
        if i == len(units):
            return True
        tried = set()
        for j, left in enumerate(free):
            if left >= units[i] and left not in tried:  # containers with as much room left are the same choice
                tried.add(left)
                free[j] -= units[i]
                if fit(i + 1):
                    return True
                free[j] += units[i]
        return False

    return fit(0)


REFUSED = [
    ([0.4] * 5, 2),  # at most two 0.4 shares to a GPU: 3 GPUs (sum 2)
    ([1] + [0.4] * 5, 3),
    ([0.6] * 3, 2),
    ([1, 1, 0.6], 2),
    ([0.3] * 7, 2),  # three to a GPU: 3 GPUs (sum 2.1 is refused by the totals too)
    ([0.26] * 7, 2),  # three 0.26 to a GPU: 3 GPUs though the sum is 1.82
    ([0.21] * 9, 2),  # four 0.21 to a GPU: 3 GPUs though the sum is 1.89
]
ACCEPTED = [
    ([0.6] * 2, 2),
    ([0.5] * 4, 2),
    ([0.4] * 4, 2),
    ([1] + [0.4] * 4, 3),
    ([0.3] * 6, 2),
    ([0.25] * 8, 2),
    ([0.2] * 10, 2),
    ([0.3333] * 6, 2),
    ([0.6, 0.4, 0.6, 0.4], 2),
    ([1, 0.5, 0.5], 2),
]


@pytest.mark.parametrize(("shares", "gpus"), REFUSED)
def test_shares_that_cannot_share_a_gpu_are_refused(shares: list[float], gpus: int) -> None:
    assert not placeable(shares, gpus)
    with pytest.raises(PlacementError, match="GPU"):
        check_node_placement(share_roles(shares), [{"CPU": 64.0, "GPU": float(gpus)}])


@pytest.mark.parametrize(("shares", "gpus"), ACCEPTED)
def test_shares_ray_can_place_pass(shares: list[float], gpus: int) -> None:
    assert placeable(shares, gpus)
    check_node_placement(share_roles(shares), [{"CPU": 64.0, "GPU": float(gpus)}])


def test_the_refusal_names_the_roles_the_share_and_the_shortfall() -> None:
    rm = RoleResources("environment:rm", 5, WorkerResources(num_cpus=0.1, num_gpus=0.4))
    with pytest.raises(PlacementError) as err:
        check_node_placement([rm], [{"CPU": 8.0, "GPU": 2.0}])
    assert (
        "5 bundles ask for more than 1/3 of a GPU each (environment:rm 0.4), of which no 3 can share a GPU (at most 2 to "
        "a GPU), besides 0 whole GPUs: 3 GPUs, and the nodes have 2: short by GPU 1"
    ) in str(err.value)
    policy = RoleResources("policy", 1, WorkerResources(num_cpus=1, num_gpus=1))
    with pytest.raises(PlacementError, match=r"\(environment:rm 0.4\).*besides 1 whole GPUs: 4 GPUs, and the nodes have 3: short by GPU 1"):
        check_node_placement([policy, rm], [{"CPU": 8.0, "GPU": 3.0}])


def test_the_share_bound_never_refuses_a_layout_ray_can_place() -> None:
    """Against an exhaustive placement, on random small layouts of fractions and whole GPUs."""
    rng = random.Random(0)
    sizes = [0.1, 0.2, 0.25, 0.3, 0.3333, 0.34, 0.4, 0.5, 0.55, 0.6, 0.75, 1.0]
    refused = 0
    for _ in range(600):
        shares = [rng.choice(sizes) for _ in range(rng.randint(1, 8))]
        gpus = rng.randint(1, 3)
        try:
            check_node_placement(share_roles(shares), [{"CPU": 64.0, "GPU": float(gpus)}])
        except PlacementError:
            refused += 1
            assert not placeable(shares, gpus), (shares, gpus)
    assert refused  # the sample does exercise refusals
    for shares in itertools.product([0.3, 0.4, 0.6], repeat=4):  # and every layout of these sizes on 2 GPUs
        if placeable(list(shares), 2):
            check_node_placement(share_roles(list(shares)), [{"CPU": 64.0, "GPU": 2.0}])


def rewards_recipe(*overrides: str) -> tuple[MasterConfig, RunPlan]:
    """The composed-reward tiny recipe (a reward model source) with ``overrides``, and its run plan."""
    cfg = load_config(RECIPES / "grpo_tiny_rewards_cpu.yaml", list(overrides))
    return cfg, decide_run_plan(cfg, (), 8)


def test_a_recipe_whose_reward_model_shares_cannot_fit_is_refused_before_placement() -> None:
    """Five reward-model actors of 0.4 GPU beside a 1-GPU policy on one 3-GPU node: totals 3 <= 3, but the two GPUs the
    policy leaves hold four such shares, not five (the run had waited out cluster.placement_timeout_s)."""
    cfg, plan = rewards_recipe(
        "cluster.gpus_per_node=3",
        "env.arithmetic.num_workers=5",
        "+env.arithmetic.sources.rm.num_gpus=0.4",
        "loss_fn.reference_policy_kl_penalty=0",
        "policy.generation.backend=inline",
    )
    with pytest.raises(PlacementError, match=r"5 bundles ask for more than 1/3 of a GPU each \(environment:arithmetic 0.4\)"):
        roles._check_against(cfg, plan, {"CPU": 16.0, "GPU": 3.0}, "", [{"CPU": 16.0, "GPU": 3.0}])
    cfg, plan = rewards_recipe(
        "cluster.gpus_per_node=3",
        "env.arithmetic.num_workers=4",
        "+env.arithmetic.sources.rm.num_gpus=0.4",
        "loss_fn.reference_policy_kl_penalty=0",
        "policy.generation.backend=inline",
    )
    roles._check_against(cfg, plan, {"CPU": 16.0, "GPU": 3.0}, "", [{"CPU": 16.0, "GPU": 3.0}])  # four fit


def test_a_private_cluster_gets_no_gpu_with_gpus_per_node_zero() -> None:
    cpu, gpu = rewards_recipe()[0].cluster, rewards_recipe("cluster.gpus_per_node=1")[0].cluster
    assert roles.private_cluster_gpus(cpu, 2) == 0.0
    assert roles.private_cluster_gpus(gpu, 2) == 2.0


@pytest.fixture
def private_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run would start a private local cluster (whatever Ray or the environment in this test process say)."""
    monkeypatch.setattr(ray_init, "joins_existing_cluster", lambda cluster: False)


def test_gpus_per_node_zero_hides_the_machines_gpus_from_a_role_that_needs_one(private_cluster: None) -> None:
    """A CPU recipe whose reward model asks for a GPU, on a 2-GPU machine: the private cluster starts with none, so the
    check refuses it before Ray starts, and says so instead of advising cluster.gpus_per_node=0 (already the setting)."""
    cfg, plan = rewards_recipe("+env.arithmetic.sources.rm.num_gpus=1")
    assert cfg.cluster.gpus_per_node == 0
    with pytest.raises(PlacementError) as err:
        roles.ensure_private_cluster_gpus(cfg, plan, machine_gpus=2)
    message = str(err.value)
    assert "short by GPU 1" in message and "environment:arithmetic 1 x CPU 0.55, GPU 1" in message
    assert "cluster.gpus_per_node=0 hides this machine's 2 GPUs from it, yet roles ask for a GPU (environment:arithmetic)" in message
    assert "Set those roles' num_gpus to 0, or cluster.gpus_per_node > 0 to give it them (then the policy" in message
    assert "set cluster.gpus_per_node=0" not in message
    with pytest.raises(PlacementError, match="this machine has no GPU either") as err:  # and on a machine without GPUs
        roles.ensure_private_cluster_gpus(cfg, plan, machine_gpus=0)
    assert "gpus_per_node > 0" not in str(err.value)
    roles.ensure_private_cluster_gpus(*rewards_recipe(), machine_gpus=2)  # no role asks for a GPU


def test_a_gpu_recipe_still_gets_the_machines_gpus(private_cluster: None) -> None:
    cfg, plan = rewards_recipe("cluster.gpus_per_node=1", "loss_fn.reference_policy_kl_penalty=0", "policy.generation.backend=inline")
    roles.ensure_private_cluster_gpus(cfg, plan, machine_gpus=1)
    with pytest.raises(PlacementError, match=r"\(0 GPUs found\): set cluster.gpus_per_node=0 to run on CPU"):
        roles.ensure_private_cluster_gpus(cfg, plan, machine_gpus=0)


def cpu_placeable(sizes: list[float], nodes: list[float]) -> bool:
    """Whether CPU bundles of ``sizes`` fit on nodes of ``nodes`` CPUs (Ray grants a bundle out of one node), by trying
    every assignment; in Ray's units of 1/10000."""
    return fits([round(c * 10_000) for c in sizes], [round(n * 10_000) for n in nodes])


def cpu_roles(sizes: list[float]) -> list[RoleResources]:
    return [RoleResources(f"role{c:g}", sizes.count(c), WorkerResources(num_cpus=c)) for c in sorted(set(sizes))]


def test_cpu_bundles_no_arrangement_of_the_nodes_holds_are_refused_and_a_placeable_layout_never_is() -> None:
    """Three bundles of 0.6 CPU from two roles on two 1-CPU nodes (the layout of test_multi_node): 1.8 <= 2 CPUs in
    total and each bundle fits a node, so every check passed, and the run waited out cluster.placement_timeout_s."""
    two_roles = [
        RoleResources("policy", 2, WorkerResources(num_cpus=0.6)),
        RoleResources("generation", 1, WorkerResources(num_cpus=0.6)),
        RoleResources("environment", 1, WorkerResources(num_cpus=0.1)),
    ]
    assert not cpu_placeable([0.6, 0.6, 0.6, 0.1], [1.0, 1.0])
    with pytest.raises(PlacementError) as err:
        check_node_placement(two_roles, [{"CPU": 1.0}, {"CPU": 1.0}])
    assert (
        "3 bundles ask for more than 1/2 of the largest node's 1 CPUs each (generation 0.6, policy 0.6), at most 1 to a "
        "node: 3 nodes, and the cluster has 2"
    ) in str(err.value)
    check_node_placement(two_roles, [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}])
    rng = random.Random(0)
    refused = 0
    for _ in range(800):  # against an exhaustive placement on random small layouts
        sizes = [rng.choice([0.1, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0]) for _ in range(rng.randint(1, 7))]
        nodes = [rng.choice([1.0, 2.0])] * rng.randint(1, 3) if rng.random() < 0.7 else [rng.choice([1.0, 2.0]) for _ in range(3)]
        if sum(sizes) > sum(nodes):
            continue  # the totals check's case
        try:
            check_node_placement(cpu_roles(sizes), [{"CPU": n} for n in nodes])
        except PlacementError:
            refused += 1
            assert not cpu_placeable(sizes, nodes), (sizes, nodes)
    for sizes in itertools.product([0.3, 0.4, 0.6], repeat=5):  # and every layout of these sizes on two 1-CPU nodes
        try:
            check_node_placement(cpu_roles(list(sizes)), [{"CPU": 1.0}, {"CPU": 1.0}])
        except PlacementError:
            refused += 1
            assert not cpu_placeable(list(sizes), [1.0, 1.0]), sizes
    assert refused  # the layouts do exercise refusals
