"""The automatic thread split (pure rule, hand-computed cases) and the oversubscription warning."""

from pathlib import Path

import pytest

from nemo_like.config import load_config
from nemo_like.config.errors import ConfigError
from nemo_like.plan.logprob_passes import decide_logprob_passes
from nemo_like.plan.threads import (
    PhaseActors,
    ThreadSplit,
    oversubscription,
    oversubscription_warning,
    per_node,
    phase_actors,
    shared_cores_warning,
    split_threads,
    thread_split,
)

RECIPES = Path(__file__).resolve().parents[3] / "examples" / "configs"
SYNC, ASYNC = RECIPES / "grpo_tiny_cpu.yaml", RECIPES / "grpo_tiny_cpu_async.yaml"


def threads(split: ThreadSplit) -> tuple[int, int, int]:
    return split.policy, split.reference, split.generation


def actors_of(cfg, cpus: int = 2) -> PhaseActors:
    return phase_actors(cfg, decide_logprob_passes(cfg), cpus)


def split_of(cfg, cpus: int) -> ThreadSplit:
    return thread_split(cfg, cpus, decide_logprob_passes(cfg))


def warning_of(cfg, cpus: int) -> str | None:
    return oversubscription_warning(cfg, split_of(cfg, cpus), actors_of(cfg))


def test_sync_gives_every_phase_all_cores():
    # Phases: logprobs {reference 1}, training {policy 1}, generation {1}: nothing overlaps.
    actors = PhaseActors(policy=1, reference=1, generation=1, prev_pass=False)
    assert threads(split_threads(2, actors, async_mode=False)) == (2, 2, 2)
    assert threads(split_threads(16, actors, async_mode=False)) == (16, 16, 16)


def test_sync_concurrent_logprob_passes_share_the_cores():
    # prev pass on: the logprob phase runs 2 policy + 2 reference ranks at once -> 16 // 4 = 4 there; the policy's
    # training runs alone -> 16 // 2 = 8 (the worker switches between the two); generation alone gets 16.
    actors = PhaseActors(policy=2, reference=2, generation=1, prev_pass=True)
    split = split_threads(16, actors, async_mode=False)
    assert (split.policy, split.policy_logprobs, split.reference, split.generation) == (8, 4, 4, 16)
    assert split.in_phase("policy", {"policy": 2, "reference": 2}) == 4 and split.in_phase("policy", {"policy": 2}) == 8
    assert "policy 8 (auto; 4 in the logprob phase" in split.describe()
    # no reference: the policy ranks share only with each other (16 // 2) in both phases
    split = split_threads(16, PhaseActors(2, 0, 1, prev_pass=True), async_mode=False)
    assert (split.policy, split.policy_logprobs, split.generation) == (8, 0, 16)
    # an explicit count is used in every phase, and inline sampling (no engine actor) is said as such
    split = split_threads(16, PhaseActors(2, 2, 0, prev_pass=True), async_mode=False, policy_threads=3)
    assert (split.policy, split.policy_logprobs) == (3, 0) and "generation inline (in the policy worker" in split.describe()


def test_async_generation_and_training_share_the_cores():
    # Generation runs beside every trainer phase: 1 engine + 1 policy (or 1 reference) rank.
    actors = PhaseActors(policy=1, reference=1, generation=1, prev_pass=False)
    assert threads(split_threads(2, actors, async_mode=True)) == (1, 1, 1)
    assert threads(split_threads(16, actors, async_mode=True)) == (8, 8, 8)
    # 4 policy ranks on the node: training phase 4 + engine 1 -> 16 // 5 = 3 each
    assert threads(split_threads(16, PhaseActors(4, 4, 1, prev_pass=False), async_mode=True)) == (3, 3, 3)
    # prev pass: logprob phase 4 + 4 ranks + engine -> 16 // 9 = 1
    assert threads(split_threads(16, PhaseActors(4, 4, 1, prev_pass=True), async_mode=True)) == (1, 1, 1)


def test_async_reference_pass_beside_training_counts_in_every_phase():
    # The collector's reference pass may overlap training and generation: 1 policy + 1 reference + 1 engine.
    beside = PhaseActors(policy=1, reference=1, generation=1, reference_beside_training=True)
    assert threads(split_threads(2, beside, async_mode=True)) == (1, 1, 1)
    assert threads(split_threads(16, beside, async_mode=True)) == (5, 5, 5)  # 16 // 3, not 8 each (24 threads on 16)
    assert threads(split_threads(16, PhaseActors(4, 4, 1, reference_beside_training=True), async_mode=True)) == (1, 1, 1)
    assert oversubscription(split_threads(16, beside, async_mode=True), beside) is None


def test_never_below_one_thread():
    assert threads(split_threads(1, PhaseActors(4, 4, 1, prev_pass=True), async_mode=True)) == (1, 1, 1)
    with pytest.raises(ValueError, match="cpus must be >= 1"):
        split_threads(0, PhaseActors(1, 0, 1), async_mode=False)


def test_explicit_counts_are_kept_and_auto_fills_the_rest_in_async():
    actors = PhaseActors(policy=1, reference=1, generation=1)
    split = split_threads(16, actors, async_mode=True, policy_threads=12)
    assert threads(split) == (12, 12, 4)  # generation: (16 - 1 x 12) // 1
    assert split.explicit == ("policy", "reference")
    split = split_threads(16, actors, async_mode=True, generation_threads=6)
    assert threads(split) == (10, 10, 6)  # trainer: (16 - 6) // 1
    assert split.explicit == ("generation",)
    # sync: an explicit count does not change the other phases
    assert threads(split_threads(16, actors, async_mode=False, policy_threads=3)) == (3, 3, 16)
    # explicit oversubscription: auto still gets at least one thread
    assert threads(split_threads(2, actors, async_mode=True, policy_threads=2)) == (2, 2, 1)


def test_oversubscription_needs_multi_threaded_actors():
    actors = PhaseActors(policy=1, reference=1, generation=1)
    two_each = ThreadSplit(policy=2, reference=2, generation=2, cpus=2, async_mode=True, explicit=("policy",))
    assert oversubscription(two_each, actors) == (4, "reference+generation")
    # three single-threaded actors on 2 CPUs only take turns
    ones = ThreadSplit(policy=1, reference=1, generation=1, cpus=2, async_mode=True, explicit=())
    assert oversubscription(ones, PhaseActors(1, 1, 1, prev_pass=True)) is None
    # sync: phases never overlap
    assert oversubscription(ThreadSplit(2, 2, 2, cpus=2, async_mode=False, explicit=()), actors) is None


def test_actors_spread_over_nodes():
    assert [per_node(n, 2) for n in (1, 2, 3, 8)] == [1, 1, 2, 4]
    spread = ["policy.dp_size=4", "policy.dtensor_cfg.enabled=true", "cluster.num_nodes=2", "cluster.placement_strategy=SPREAD"]
    assert actors_of(load_config(SYNC, spread)) == PhaseActors(policy=2, reference=2, generation=1, prev_pass=False)
    cfg = load_config(SYNC, ["loss_fn.reference_policy_kl_penalty=0"])
    assert actors_of(cfg).reference == 0


def test_a_lora_reference_is_the_policy_so_no_reference_ranks_share_the_cores():
    # LoRA: the policy computes the reference logprobs with its adapters disabled; no reference actors start
    lora = ["policy.lora_cfg.enabled=true", "grpo.skip_prev_logprobs=false"]
    cfg = load_config(SYNC, lora)
    assert decide_logprob_passes(cfg).compute_reference and actors_of(cfg).reference == 0
    assert split_of(cfg, cpus=8).policy == 8  # sync: the policy rank alone in every trainer phase
    async_lora = [*lora, "grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
    assert split_of(load_config(SYNC, async_lora), cpus=8).policy == 4  # beside the one engine
    full = split_of(load_config(SYNC, lora[1:]), cpus=8)  # full fine-tuning: its logprob phase beside its reference rank
    assert (full.policy, full.policy_logprobs) == (8, 4)


def test_shipped_recipes_use_the_automatic_split():
    assert threads(split_of(load_config(SYNC), cpus=2)) == (2, 2, 2)
    assert threads(split_of(load_config(ASYNC), cpus=2)) == (1, 1, 1)
    assert warning_of(load_config(ASYNC), cpus=2) is None
    line = split_of(load_config(ASYNC), cpus=2).describe()
    assert line == (
        "threads per worker on 2 CPUs per node (async: generation and training share the cores): "
        "policy 1 (auto), reference 1 (auto), generation 1 (auto)"
    )
    # No reference workers (the KL penalty 0): the line lists none (it said 'reference 1 (auto)')
    no_kl = split_of(load_config(ASYNC, ["loss_fn.reference_policy_kl_penalty=0"]), cpus=2).describe()
    assert "reference" not in no_kl and "policy 1 (auto), generation 1 (auto)" in no_kl


def test_explicit_oversubscription_warns_with_the_automatic_counts():
    cfg = load_config(ASYNC, ["policy.num_threads_per_worker=2", "policy.generation.num_threads_per_worker=2"])
    warning = warning_of(cfg, cpus=2)
    # The async collector's reference pass may run beside training and generation: 2 + 2 + 2 threads.
    assert warning and "policy+reference+generation run at the same time with 6 threads on 2 CPUs" in warning
    assert "(here: policy 1, generation 1)" in warning
    assert warning_of(cfg, cpus=8) is None
    assert warning_of(load_config(SYNC, ["policy.num_threads_per_worker=2"]), cpus=2) is None


@pytest.mark.parametrize("value", ["0", "-1", "many", "2.5"])
def test_bad_thread_counts_name_the_key(value):
    with pytest.raises(ConfigError, match=r"policy\.generation\.num_threads_per_worker: expected a positive integer or 'auto'"):
        load_config(SYNC, [f"policy.generation.num_threads_per_worker={value}"])
    with pytest.raises(ConfigError, match=r"policy\.num_threads_per_worker: expected an integer, not a boolean"):
        load_config(SYNC, ["policy.num_threads_per_worker=true"])


def test_a_cpu_run_splits_threads_over_the_nodes_its_cluster_has(ray_cluster):
    """The split counted cluster.num_nodes as declared: a laptop recipe's 1 on two nodes gave each of two SPREAD ranks 1
    of its node's 2 cores; a recipe of 2 nodes on one machine's private cluster gave two ranks 2 threads each on 2."""
    from nemo_like.distributed.planning import plan_on_cluster
    from nemo_like.models.footprint import planned_memory_lines
    from nemo_like.models.loading import resolve_model_path
    from nemo_like.plan.run_plan import decide_run_plan
    from nemo_like.plan.threads import node_count_warning
    from nemo_like.utils.flops import flops_spec

    spread = ["policy.dp_size=2", "cluster.placement_strategy=SPREAD", "loss_fn.reference_policy_kl_penalty=0"]
    laptop = load_config(SYNC, spread, warn=False)  # cluster.num_nodes 1
    assert decide_run_plan(laptop, (), 2).threads.policy == 1  # two ranks on one node of 2 CPUs
    on_two = decide_run_plan(laptop, (), 2, nodes=2)  # the same recipe on a cluster of two nodes
    assert (on_two.nodes, on_two.threads.policy) == (2, 2)
    model = resolve_model_path(laptop.policy.model_name)
    assert flops_spec(laptop, model, on_two).devices == 2  # SPREAD: a rank on each node, each node a device
    packed = load_config(SYNC, [*spread, "cluster.placement_strategy=PACK"], warn=False)
    assert flops_spec(packed, model, decide_run_plan(packed, (), 2, nodes=2)).devices == 1  # PACK: both ranks on one node
    assert node_count_warning(laptop, 2) == (
        "cluster.num_nodes is 1, but the Ray cluster has 2 node(s) with CPUs, any of which Ray may place the actors on: "
        "the run plans for 2 (the thread split, the MFU's devices, the [plan] memory lines); set cluster.num_nodes=2 "
        "(nemo-like plan takes the declared count)"
    )
    cluster_recipe = load_config(SYNC, [*spread, "cluster.num_nodes=2"], warn=False)
    run = plan_on_cluster(cluster_recipe)  # this session's cluster: one node
    assert (run.nodes, run.threads.policy) == (1, 1) and "has 1 node(s)" in node_count_warning(cluster_recipe, run.nodes)
    one_node = load_config(SYNC, spread, warn=False)
    memory = [line for line in planned_memory_lines(cluster_recipe, run) if "on each node" in line]
    assert memory and memory == [line for line in planned_memory_lines(one_node, plan_on_cluster(one_node)) if "on each node" in line]
    planned = plan_on_cluster(cluster_recipe, planning_only=True)  # nemo-like plan: the declared nodes
    assert (planned.nodes, planned.threads.policy) == (2, 2) and node_count_warning(cluster_recipe, planned.nodes) is None
    gpu = load_config(SYNC, [*spread, "cluster.num_nodes=2", "cluster.gpus_per_node=1"], warn=False)
    assert node_count_warning(gpu, 1) is None  # GPU clusters keep the declared count (capacity compares the GPUs)


def test_a_run_warns_at_start_when_its_cluster_has_other_nodes_than_declared(ray_cluster, monkeypatch):
    from nemo_like.algorithms import setup

    class PolicyStarted(Exception):
        pass

    def policy_starts(*_args, **_kwargs):
        raise PolicyStarted

    monkeypatch.setattr(setup, "init_ray", lambda *_: "local")
    monkeypatch.setattr(setup, "ensure_cluster_capacity", lambda *_, **__: None)
    monkeypatch.setattr(setup, "Policy", policy_starts)  # the warning comes before any actor starts
    cfg = load_config(SYNC, ["cluster.num_nodes=2", "loss_fn.reference_policy_kl_penalty=0"], warn=False)
    with pytest.warns(RuntimeWarning, match=r"cluster.num_nodes is 2, but the Ray cluster has 1 node\(s\) with CPUs"):
        with pytest.raises(PolicyStarted):
            setup.setup_grpo(cfg)


def test_other_runs_on_the_machine_get_a_warning_with_each_runs_share_of_the_cores():
    """Two runs at once each took every core with 'auto' (their OpenMP teams spun against each other), silently."""
    other = ["pid 41, started 09:00:00, writing to /tmp/a"]
    cfg = load_config(ASYNC)  # an engine actor: both counts are advised
    split, actors = split_of(cfg, 12), actors_of(cfg, 12)
    assert threads(split) == (4, 4, 4)  # async: the policy, the reference and the engine share the 12 CPUs
    line = shared_cores_warning(cfg, split, actors, other)
    assert line.startswith("another nemo-like run is alive on this machine (pid 41, started 09:00:00, writing to /tmp/a)")
    assert "each run takes all 12 CPUs" in line  # on its half of the cores (6), auto gives each 2
    assert line.endswith("give each run its share: policy.num_threads_per_worker=2 policy.generation.num_threads_per_worker=2")
    three = shared_cores_warning(cfg, split_of(cfg, 2), actors_of(cfg, 2), other * 2)
    assert three.startswith("2 other nemo-like runs are alive") and "policy.num_threads_per_worker=1 " in three  # never 0
    # the inline backend samples in the policy worker: only its count is advised; sync gives the training phase all
    inline = load_config(SYNC, ["policy.generation.backend=inline", "loss_fn.reference_policy_kl_penalty=0"])
    logprobs = decide_logprob_passes(inline)
    inline_split = thread_split(inline, 8, logprobs, inline=True)
    line = shared_cores_warning(inline, inline_split, phase_actors(inline, logprobs, 8, inline=True), other)
    assert line.endswith("give each run its share: policy.num_threads_per_worker=4")
    explicit = load_config(ASYNC, ["policy.num_threads_per_worker=2", "policy.generation.num_threads_per_worker=2"])
    assert shared_cores_warning(explicit, split_of(explicit, 8), actors_of(explicit, 8), other) is None  # the user's choice
    half = load_config(ASYNC, ["policy.num_threads_per_worker=2"])  # the engine's count is still automatic
    assert shared_cores_warning(half, split_of(half, 8), actors_of(half, 8), other) is not None
    assert shared_cores_warning(cfg, split, actors, []) is None
    evaluating = shared_cores_warning(cfg, split, actors, other, trains=False)  # nemo-like eval: its engines only
    assert evaluating.endswith("give each run its share: policy.generation.num_threads_per_worker=2")
    gpus = load_config(SYNC, ["cluster.gpus_per_node=1"])
    assert shared_cores_warning(gpus, split, actors, other) is None  # a GPU run's speed is its GPUs'
