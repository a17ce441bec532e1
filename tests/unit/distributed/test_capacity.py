"""The run's resource request, the fail-fast capacity check, and how the driver decides where to run."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from nemo_like.algorithms import roles as capacity
from nemo_like.algorithms.roles import declared_resources
from nemo_like.config import MasterConfig, load_config
from nemo_like.config.errors import ConfigError
from nemo_like.distributed.capacity import check_cluster_capacity, private_cluster_hint, shortfall
from nemo_like.distributed.ray_env import (
    address_from_env,
    apply_driver_defaults,
    in_ray_job,
    job_submission_id,
    job_working_dir,
    worker_env_vars,
)
from nemo_like.distributed.worker_group import PlacementError
from nemo_like.models.generation.vllm import vllm_available
from nemo_like.plan.logprob_passes import LogprobPlan
from nemo_like.plan.run_plan import decide_run_plan

TINY_RECIPE = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_tiny_cpu.yaml"
CPU_HEAD = {"CPU": 2.0, "memory": 2e10, "object_store_memory": 2.6e8, "node:127.0.0.1": 1.0}


def tiny(*overrides: str) -> MasterConfig:
    return load_config(TINY_RECIPE, list(overrides))


def role_requests(cfg: MasterConfig):
    """The roles as setup asks for them: with the logprob plan decided once, from the same config."""
    return capacity.role_requests(cfg, decide_run_plan(cfg, (), 2))


def required_resources(cfg: MasterConfig) -> dict[str, float]:
    return capacity.required_resources(cfg, decide_run_plan(cfg, (), 2))


def test_tiny_recipe_asks_for_cpu_bundles_only_per_role() -> None:
    roles = {r.role: (r.count, dict(r.bundle)) for r in role_requests(tiny())}
    assert roles == {
        "policy": (1, {"CPU": 0.5}),
        "reference": (1, {"CPU": 0.5}),  # reference_policy_kl_penalty: 0.01 in the tiny recipe
        "generation": (0, {"CPU": 0}),  # auto -> inline: the policy worker samples, no engine actor
        "environment:arithmetic": (1, {"CPU": 0.1}),
    }
    assert required_resources(tiny()) == {"CPU": 1.1}
    engine = {r.role: (r.count, dict(r.bundle)) for r in role_requests(tiny("policy.generation.backend=hf"))}
    assert engine["generation"] == (1, {"CPU": 0.5})
    assert required_resources(tiny("policy.generation.backend=hf")) == {"CPU": 1.6}


def test_no_reference_role_without_kl_penalty_and_dp_multiplies_the_policy() -> None:
    cfg = tiny(
        "loss_fn.reference_policy_kl_penalty=0", "policy.dp_size=2", "env.arithmetic.num_workers=3", "policy.num_cpus_per_worker=0.25"
    )
    assert [r.role for r in role_requests(cfg)] == ["policy", "generation", "environment:arithmetic"]
    assert required_resources(cfg) == {"CPU": pytest.approx(2 * 0.25 + 0.25 + 3 * 0.1)}


def test_gpu_recipe_asks_one_gpu_per_model_worker_and_at_least_the_declared_gpus() -> None:
    cfg = tiny("cluster.gpus_per_node=8", "policy.dp_size=2", "policy.generation.backend=hf")
    assert all(r.bundle.get("GPU") == 1.0 for r in role_requests(cfg) if not r.role.startswith("environment"))
    assert declared_resources(cfg) == {"GPU": 8.0}
    assert required_resources(cfg)["GPU"] == 8.0  # declared 1 x 8 > 2 policy + 2 reference + 1 generation
    many = tiny("cluster.gpus_per_node=1", "policy.dp_size=4", "policy.generation.backend=hf")
    assert required_resources(many)["GPU"] == 9.0  # 4 policy + 4 reference (sharded like the policy) + 1 generation


def test_two_nodes_declare_twice_the_gpus_per_node() -> None:
    assert declared_resources(tiny("cluster.num_nodes=2", "cluster.gpus_per_node=4")) == {"GPU": 8.0}
    assert declared_resources(tiny("cluster.num_nodes=2")) == {}


def test_shortfall_is_per_resource_and_ignores_float_noise() -> None:
    assert shortfall({"CPU": 0.1 + 0.2}, {"CPU": 0.3}) == {}
    assert shortfall({"CPU": 1.6, "GPU": 8.0}, CPU_HEAD) == {"GPU": 8.0}
    assert shortfall({"CPU": 3.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 4.0}) == {"CPU": 1.0}


def test_a_request_that_fits_passes() -> None:
    check_cluster_capacity(required_resources(tiny()), CPU_HEAD)
    check_cluster_capacity({"CPU": 2.0}, CPU_HEAD)  # exactly the cluster


def test_too_many_gpus_fail_with_roles_totals_and_the_shortfall_named() -> None:
    cfg = tiny("cluster.gpus_per_node=8")
    with pytest.raises(PlacementError) as err:
        check_cluster_capacity(required_resources(cfg), CPU_HEAD, role_requests(cfg), declared_resources(cfg))
    msg = str(err.value)
    assert "short by GPU 8" in msg
    assert "policy 1 x CPU 0.5, GPU 1" in msg and "environment:arithmetic 1 x CPU 0.1" in msg
    assert "cluster.num_nodes x cluster.gpus_per_node = GPU 8" in msg
    assert "Asked for in total: CPU 1.6, GPU 8." in msg
    assert "The cluster has in total: CPU 2, GPU 0." in msg


def test_too_many_cpus_fail_too() -> None:
    cfg = tiny("policy.dp_size=4", "policy.num_cpus_per_worker=1")
    with pytest.raises(PlacementError, match=r"short by CPU 7.1\b"):
        check_cluster_capacity(required_resources(cfg), CPU_HEAD, role_requests(cfg))
    # The private cluster's GPU hint goes with a GPU shortfall only: a CPU one was told that "roles ask for a GPU".
    hint = private_cluster_hint(0.0, 0, [])
    with pytest.raises(PlacementError) as err:
        check_cluster_capacity(required_resources(cfg), CPU_HEAD, role_requests(cfg), hint=hint)
    assert "GPU" not in str(err.value)
    with pytest.raises(PlacementError, match="roles ask for a GPU"):
        gpus = tiny("cluster.gpus_per_node=8")
        check_cluster_capacity(required_resources(gpus), CPU_HEAD, role_requests(gpus), hint=hint)


def test_plan_refuses_a_cpu_run_its_private_cluster_cannot_hold() -> None:
    """`nemo-like plan` said "fits" for a one-node CPU recipe whose actors reserve more CPUs than the private cluster
    a run starts (this machine's cores, or cluster.num_cpus), which the run refused once Ray had started."""
    import subprocess
    import sys

    from nemo_like.algorithms.roles import private_cpus_problem
    from nemo_like.distributed.planning import plan_on_cluster

    # In a fresh process, as `nemo-like plan` runs: no cluster to join (another test of this worker may have joined one)
    script = (
        "from nemo_like.algorithms.roles import private_cpus_problem\nfrom nemo_like.cli import main\n"
        "from nemo_like.config import load_config\nfrom nemo_like.distributed.planning import plan_on_cluster\n"
        f"cfg = load_config({str(TINY_RECIPE)!r}, ['policy.dp_size=2', 'cluster.num_cpus=2'])\n"
        "print(private_cpus_problem(cfg, plan_on_cluster(cfg)))\n"
        f"roomy = load_config({str(TINY_RECIPE)!r}, ['policy.dp_size=2', 'cluster.num_cpus=3'])\n"
        "print(private_cpus_problem(roomy, plan_on_cluster(roomy)))\n"
        f"print('exit', main(['plan', '--config', {str(TINY_RECIPE)!r}, 'policy.dp_size=2', 'cluster.num_cpus=2']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    problem, roomy, *plan_lines = done.stdout.splitlines()
    assert problem == (
        "the run's actors reserve 2.6 CPUs (policy 1, reference 1, generation 0.5, environment:arithmetic 0.1) but its "
        "private local cluster has 2 (cluster.num_cpus, else this machine's cores): short by 0.6"
    ), done.stderr[-2000:]
    assert roomy == "None" and plan_lines[-1] == "exit 3"
    assert any(line.startswith("[plan] fits: NO: the run's actors reserve 2.6 CPUs") for line in plan_lines)
    for fits in (["cluster.num_cpus=2", "cluster.num_nodes=2"], ["cluster.num_cpus=2", "cluster.ray_address=auto"]):
        cfg = tiny("policy.dp_size=2", *fits)  # a cluster whose CPUs are not known here
        assert private_cpus_problem(cfg, plan_on_cluster(cfg)) is None, fits


# Where the driver runs: decided from the environment alone (see nemo_like/distributed/ray_env.py).

JOB_ENV = {  # what Ray 2.60's job supervisor sets in a submitted entrypoint (measured)
    "RAY_ADDRESS": "127.0.0.1:6390",
    "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(
        {"runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip"}, "metadata": {"job_submission_id": "raysubmit_abc"}}
    ),
}


def test_a_plain_local_run_starts_a_private_cluster() -> None:
    assert address_from_env({}) is None and not in_ray_job({})


def test_a_submitted_job_joins_its_cluster() -> None:
    assert in_ray_job(JOB_ENV) and address_from_env(JOB_ENV) == "127.0.0.1:6390"
    assert job_submission_id(JOB_ENV) == "raysubmit_abc" and job_working_dir(JOB_ENV) == "gcs://_ray_pkg_x.zip"
    without_address = {k: v for k, v in JOB_ENV.items() if k != "RAY_ADDRESS"}
    assert address_from_env(without_address) == "auto"


def test_ray_address_alone_joins_that_cluster() -> None:
    assert address_from_env({"RAY_ADDRESS": "10.0.0.1:6379"}) == "10.0.0.1:6379"
    assert address_from_env({"RAY_ADDRESS": ""}) is None
    assert job_submission_id({"RAY_JOB_CONFIG_JSON_ENV_VAR": "not json"}) is None
    assert job_working_dir({"RAY_JOB_CONFIG_JSON_ENV_VAR": "not json"}) is job_working_dir({}) is None


def test_local_defaults_fill_gaps_only_and_are_taken_back_when_joining(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    apply_driver_defaults(joining=False)
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
    apply_driver_defaults(joining=True)  # e.g. cluster.ray_address in the recipe: use the cluster's auth mode
    assert "RAY_AUTH_MODE" not in os.environ
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # the user's choice always wins
    apply_driver_defaults(joining=False)
    apply_driver_defaults(joining=True)
    assert os.environ["RAY_AUTH_MODE"] == "token"


def test_actors_get_the_drivers_pythonpath(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """On a joined cluster the actors' environment is the `ray start` shell's: a reward module importable in the driver
    through PYTHONPATH failed to import in them."""
    from ray._private.utils import update_envs  # what Ray runs in the actor's process with the runtime env's variables

    path = f"{tmp_path / 'userpkg'}:{tmp_path / 'more'}"
    monkeypatch.setenv("PYTHONPATH", path)
    forwarded = worker_env_vars()
    assert forwarded["PYTHONPATH"].startswith(path) and worker_env_vars(2) == {**forwarded, "OMP_NUM_THREADS": "2"}
    # ... and the node's own path stays after it (Ray sets the variable whole: the `ray start` shell's path was lost)
    monkeypatch.setenv("PYTHONPATH", "/node/pkgs")
    update_envs({"PYTHONPATH": forwarded["PYTHONPATH"]})
    assert os.environ["PYTHONPATH"] == f"{path}:/node/pkgs"
    monkeypatch.delenv("PYTHONPATH")
    assert "PYTHONPATH" not in worker_env_vars()
    # An empty entry (a leading, doubled or trailing separator; PYTHONPATH='') is the actor's working directory on its
    # sys.path: dropped, and nothing is forwarded when nothing is left
    monkeypatch.setenv("PYTHONPATH", f":{path}::")
    assert worker_env_vars()["PYTHONPATH"] == f"{path}:${{PYTHONPATH}}"
    monkeypatch.setenv("PYTHONPATH", "")
    assert "PYTHONPATH" not in worker_env_vars()


def test_async_adds_the_collector_and_buffer_actors() -> None:
    sync_roles = {r.role for r in role_requests(tiny())}
    async_roles = {r.role for r in role_requests(tiny("grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"))}
    assert async_roles - sync_roles == {"trajectory_collector", "replay_buffer"}


ONE_GPU_HEAD = {"CPU": 16.0, "GPU": 1.0}


@pytest.mark.skipif(not vllm_available(), reason="colocation is a vLLM feature; vllm is not installed")
def test_colocated_vllm_shares_the_policy_gpu_so_one_gpu_is_enough() -> None:
    base = ("cluster.gpus_per_node=1", "policy.generation.backend=vllm", "loss_fn.reference_policy_kl_penalty=0")
    colocated = tiny(*base, "policy.generation.colocated.enabled=true")
    roles = {r.role: r.bundle for r in role_requests(colocated)}
    assert roles["generation"] == {"CPU": 0.5} and roles["policy"] == {"CPU": 0.5, "GPU": 1.0}
    assert required_resources(colocated)["GPU"] == 1.0
    check_cluster_capacity(required_resources(colocated), ONE_GPU_HEAD, role_requests(colocated))  # accepted

    separate = tiny(*base, "policy.generation.colocated.enabled=false")
    assert required_resources(separate)["GPU"] == 2.0  # policy + generation on its own GPU
    with pytest.raises(PlacementError, match="short by GPU 1"):
        check_cluster_capacity(required_resources(separate), ONE_GPU_HEAD, role_requests(separate))


def test_hf_generation_always_needs_its_own_gpu() -> None:
    cfg = tiny("cluster.gpus_per_node=1", "policy.generation.backend=hf", "loss_fn.reference_policy_kl_penalty=0")
    assert required_resources(cfg)["GPU"] == 2.0


def test_the_capacity_check_follows_the_plan_it_is_handed() -> None:
    cfg = tiny()  # KL penalty 0.01: the plan loads the reference model
    plan = decide_run_plan(cfg, (), 2)
    no_reference = replace(plan, logprobs=LogprobPlan(plan.logprobs.compute_prev, compute_reference=False))
    assert "reference" in {r.role for r in capacity.role_requests(cfg, plan)}
    assert "reference" not in {r.role for r in capacity.role_requests(cfg, no_reference)}


def test_requests_the_nodes_can_never_place_are_refused_whatever_the_totals() -> None:
    """Totals alone passed a bundle bigger than any node and a STRICT_SPREAD over more ranks than nodes: each waited out
    cluster.placement_timeout_s, then named nothing that was short."""
    from nemo_like.distributed.capacity import check_node_placement
    from nemo_like.distributed.worker_group import RoleResources, WorkerResources

    two_nodes = [{"CPU": 2.0}, {"CPU": 2.0}]
    big = RoleResources("policy", 1, WorkerResources(num_cpus=3))
    with pytest.raises(PlacementError, match=r"policy: one bundle \(CPU 3\) fits on no node.*2 node\(s\); the largest has CPU 2"):
        check_node_placement([big], two_nodes)
    spread = RoleResources("policy", 3, WorkerResources(num_cpus=1))
    with pytest.raises(PlacementError, match=r"policy: 3 bundles STRICT_SPREAD need 3 nodes that hold one; 2 do"):
        check_node_placement([spread], two_nodes, {"policy": "STRICT_SPREAD"})
    packed = RoleResources("policy", 3, WorkerResources(num_cpus=1))
    with pytest.raises(PlacementError, match=r"3 bundles STRICT_PACK \(CPU 3\) fit on no single node"):
        check_node_placement([packed], two_nodes, {"policy": "STRICT_PACK"})
    check_node_placement([packed, RoleResources("generation", 1, WorkerResources(num_cpus=1))], two_nodes)  # PACK spills over
    with pytest.raises(PlacementError, match=r"5 bundles ask for more than 1/3 of the largest node's 2 CPUs each"):
        check_node_placement([packed, RoleResources("generation", 2, WorkerResources(num_cpus=2))], two_nodes)  # 7 CPUs on 4
    check_node_placement([RoleResources("policy", 2, WorkerResources(num_cpus=1))], two_nodes, {"policy": "STRICT_SPREAD"})
    # A fraction of a GPU comes out of one GPU: three 0.6 shares need three GPUs though their sum, 1.8, is under 2
    gpu_node = [{"CPU": 8.0, "GPU": 2.0}]
    shares = RoleResources("environment:rm", 3, WorkerResources(num_cpus=0.1, num_gpus=0.6))
    with pytest.raises(
        PlacementError, match=r"3 bundles ask for more than half a GPU each \(environment:rm 0.6\).*3 GPUs, and the nodes have 2"
    ):
        check_node_placement([shares], gpu_node)
    with pytest.raises(PlacementError, match="more than half a GPU"):  # one share beside a whole-GPU policy on 2 GPUs
        check_node_placement([RoleResources("policy", 2, WorkerResources(num_cpus=1, num_gpus=1)), replace(shares, count=1)], gpu_node)
    check_node_placement([replace(shares, count=2)], gpu_node)  # two 0.6 shares: a GPU each
    check_node_placement([RoleResources("environment:rm", 4, WorkerResources(num_cpus=0.1, num_gpus=0.5))], gpu_node)  # halves pair up


def test_strict_spread_over_more_policy_ranks_than_declared_nodes_is_a_config_error() -> None:
    from nemo_like.config import load_config

    with pytest.raises(ValueError, match=r"STRICT_SPREAD puts each of the policy's 2 ranks .* cluster.num_nodes=1"):
        load_config(None, ["cluster.placement_strategy=STRICT_SPREAD", "policy.dp_size=2"], warn=False)
    load_config(None, ["cluster.placement_strategy=STRICT_SPREAD", "policy.dp_size=2", "cluster.num_nodes=2"], warn=False)


def test_private_cluster_sizes_a_run_cannot_apply_warn(ray_cluster) -> None:
    """A second run in a process (a sweep over cluster.num_cpus), or one that joins through $RAY_ADDRESS or a submitted
    job, ignored cluster.num_cpus / object_store_memory_mb without a word (only cluster.ray_address warned)."""
    import warnings

    from nemo_like.config.schema import ClusterConfig
    from nemo_like.distributed.ray_init import init_ray

    with pytest.warns(RuntimeWarning, match=r"cluster.num_cpus has no effect: an earlier run in this process started"):
        assert init_ray(ClusterConfig(num_cpus=7)) == "local"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        init_ray(ClusterConfig())  # nothing changed from the defaults: nothing to say


def test_a_run_naming_no_cluster_after_one_that_joined_is_refused(ray_cluster, monkeypatch) -> None:
    """A run that names no cluster asks for a private local one; after a run in this process joined a cluster it had
    silently run on the joined one (the opposite order was refused)."""
    from nemo_like.config.schema import ClusterConfig
    from nemo_like.distributed import ray_init

    gcs = ray_init._gcs_address()
    monkeypatch.setattr(ray_init, "_CONNECTED", ("joined", gcs, gcs))  # as a run that joined this cluster leaves it
    with pytest.raises(ConfigError, match="names no Ray cluster .* already connected to the Ray cluster at"):
        ray_init.init_ray(ClusterConfig())
    assert ray_init.init_ray(ClusterConfig(ray_address=gcs)) == "joined"  # naming it is fine
    # ...however it is named: the run before joined through $RAY_ADDRESS, this one names 'auto' (the docs' advice) or
    # the host by name (the strings were compared: "another cluster")
    host, port = gcs.rsplit(":", 1)
    monkeypatch.setenv("RAY_ADDRESS", gcs)
    assert ray_init.init_ray(ClusterConfig(ray_address="auto")) == "joined"
    assert ray_init.init_ray(ClusterConfig(ray_address=f"localhost:{port}")) == "joined"
    with pytest.raises(ConfigError, match=rf"names the Ray cluster at '{host}:{int(port) + 1}', but this process is already connected"):
        ray_init.init_ray(ClusterConfig(ray_address=f"{host}:{int(port) + 1}"))
    # After the caller's own ray.init (a notebook): a run naming another cluster ran on the connected one, without a word
    monkeypatch.setattr(ray_init, "_CONNECTED", None)
    with pytest.raises(
        ConfigError, match=rf"'10.9.9.9:6379', but this process is already connected to the Ray cluster at '{gcs}' \(its own ray.init\)"
    ):
        ray_init.init_ray(ClusterConfig(ray_address="10.9.9.9:6379"))
    assert ray_init.init_ray(ClusterConfig(ray_address="auto")) == "joined"
    # A Ray Client address names no GCS: the address the process connected with is what a later run must name
    client = "ray://127.0.0.1:10001"
    assert ray_init.init_ray(ClusterConfig(ray_address=client)) == "joined"  # the caller's own ray.init("ray://...")
    monkeypatch.setattr(ray_init, "_CONNECTED", ("joined", client, gcs))
    assert ray_init.init_ray(ClusterConfig(ray_address=client)) == "joined"  # a sweep's second run naming it again


def test_an_interrupted_placement_wait_removes_its_group(ray_cluster) -> None:
    """Ctrl-C during a placement wait left the pending group behind: granted later, it held its bundles with no owner
    for the rest of the driver's Ray session. A real interrupt (the main thread's KeyboardInterrupt, raised as the wait
    hands back to Python) during the wait for a group the cluster cannot place yet."""
    import _thread
    import threading

    import ray
    from ray.util import placement_group_table

    from nemo_like.distributed.worker_group import WorkerResources, reserve_bundles

    threading.Timer(0.5, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        reserve_bundles("interrupted-role", WorkerResources(num_cpus=1000), 1, 3.0)  # pending: no node has 1000 CPUs
    states = [g["state"] for g in placement_group_table().values() if g["name"].startswith("interrupted-role-")]
    assert states and all(s == "REMOVED" for s in states), states
    assert ray.is_initialized()


def test_a_failed_async_start_releases_the_replay_buffers_group(ray_cluster) -> None:
    """A restore that failed (a damaged replay_buffer.pt) left the buffer's placement group reserved: close() saw no
    rollouts to close, and the bundle stayed held for the rest of the driver's Ray session."""
    from types import SimpleNamespace

    from ray.util import placement_group_table

    from nemo_like.experience.async_rollouts import AsyncRollouts

    cfg = load_config(None, ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"], warn=False)
    before = {pg_id for pg_id, g in placement_group_table().items() if g["name"].startswith("replay_buffer")}
    with pytest.raises(Exception, match="KeyError: .groups."):
        AsyncRollouts(SimpleNamespace(cfg=cfg), 0, restored={"buffer": {}, "next_target": 1})
    groups = {pg_id: g for pg_id, g in placement_group_table().items() if g["name"].startswith("replay_buffer") and pg_id not in before}
    assert groups and all(g["state"] == "REMOVED" for g in groups.values()), groups
