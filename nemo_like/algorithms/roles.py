"""The actors a GRPO run starts, as each role states its own resources, and the capacity check over them.

Each role states what it reserves next to its own code (``policy_resources``, ``generation_resources``,
``environment_resources``, ``async_actor_resources``); the run plan (decided once, in setup) says whether the
reference model is loaded, which engine reserves what, and each actor's threads. :func:`ensure_cluster_capacity` adds the roles up
and checks them against the connected cluster before any actor starts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from nemo_like.config.schema import ClusterConfig, MasterConfig
from nemo_like.distributed.capacity import check_cluster_capacity, check_node_placement, private_cluster_hint, sum_resources
from nemo_like.distributed.worker_group import PlacementError, RoleResources, WorkerResources
from nemo_like.environments.composite import source_placement, split_source
from nemo_like.environments.worker import environment_resources
from nemo_like.experience.async_rollouts import async_actor_resources
from nemo_like.models.engines import generation_resources
from nemo_like.models.policy.policy import POLICY_ROLES, policy_resources
from nemo_like.plan.memory import JudgeSpec, ScorerSpec
from nemo_like.plan.run_plan import RunPlan
from nemo_like.utils.cpus import local_cores


def role_requests(cfg: MasterConfig, plan: RunPlan) -> list[RoleResources]:
    """Every role ``setup_grpo`` will start, as each role states it."""
    roles = [policy_resources(cfg, "policy", plan.threads)]
    if plan.logprobs.load_reference_model:
        roles.append(policy_resources(cfg, "reference", plan.threads))
    if plan.logprobs.compute_teacher:  # one group of frozen workers per teacher model
        roles.extend(policy_resources(cfg, "teacher", plan.threads) for _ in cfg.teacher.models())
    roles.append(generation_resources(cfg, plan))
    roles.extend(environment_resources(cfg))
    if cfg.grpo.async_grpo.enabled:
        roles.extend(async_actor_resources(cfg))
    return roles


def declared_resources(cfg: MasterConfig) -> dict[str, float]:
    """What the recipe says the cluster has: ``cluster.num_nodes`` x ``cluster.gpus_per_node`` GPUs."""
    gpus = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    return {"GPU": float(gpus)} if gpus else {}


def idle_gpus_warning(cfg: MasterConfig, plan: RunPlan) -> str | None:
    """A line when the recipe declares more GPUs (``cluster.num_nodes`` x ``cluster.gpus_per_node``, what a launcher
    allocates) than the run's actors reserve: the rest would sit idle for the whole run (nothing scales
    ``policy.dp_size`` with the nodes). ``None`` otherwise, or when the declared nodes cannot place the GPU bundles."""
    declared = declared_resources(cfg).get("GPU", 0.0)
    reserved = sum_resources(r.total() for r in role_requests(cfg, plan)).get("GPU", 0.0)
    if declared <= reserved or declared_placement_problem(cfg, plan):  # shares that cannot share a GPU leave none idle
        return None
    return (
        f"cluster.num_nodes x cluster.gpus_per_node = {declared:g} GPUs, but the run's actors reserve {reserved:g}: "
        f"{declared - reserved:g} would stay idle. Raise policy.dp_size (now {cfg.policy.dp_size}) to use them, or "
        "declare and allocate fewer"
    )


def reserved_gpus_problem(cfg: MasterConfig, plan: RunPlan) -> str | None:
    """A line when the run's actors reserve more GPUs than the recipe declares (``cluster.num_nodes`` x
    ``cluster.gpus_per_node``, what a launcher allocates): the run's capacity check refuses it on such a cluster.
    ``None`` when it fits, or when the recipe declares no GPU."""
    declared = declared_resources(cfg).get("GPU", 0.0)
    if not declared:
        return None
    roles = [(r.role, r.total().get("GPU", 0.0)) for r in role_requests(cfg, plan)]
    reserved = sum(gpus for _, gpus in roles)
    if reserved <= declared:
        return None
    per_role = ", ".join(f"{role} {gpus:g}" for role, gpus in roles if gpus)
    return (
        f"the run's actors reserve {reserved:g} GPUs ({per_role}) but cluster.num_nodes x cluster.gpus_per_node declares "
        f"{declared:g}: short by {reserved - declared:g}"
    )


def declared_cluster_problem(cfg: MasterConfig, plan: RunPlan) -> str | None:
    """Why the run's capacity checks would refuse it on the cluster the recipe declares (``nemo-like plan``'s fit
    verdict): GPUs short in total, GPU bundles the declared nodes cannot place, CPUs short on a private local cluster;
    ``None`` when none of them is."""
    return reserved_gpus_problem(cfg, plan) or declared_placement_problem(cfg, plan) or private_cpus_problem(cfg, plan)


def declared_placement_problem(cfg: MasterConfig, plan: RunPlan) -> str | None:
    """A line when the declared nodes (``cluster.num_nodes`` of ``cluster.gpus_per_node`` GPUs each) cannot place the
    run's GPU bundles whatever the totals say (:func:`~nemo_like.distributed.capacity.check_node_placement`, the check a
    run makes once Ray has started: GPU shares above one half that cannot share a GPU, a bundle no node holds, a strict
    placement strategy). ``None`` when they can, or when the recipe declares no GPU. The nodes' CPUs are not declared:
    they are not checked here."""
    if not cfg.cluster.gpus_per_node:
        return None
    roles = [  # the GPUs alone: the nodes' CPUs are not declared
        replace(r, resources=WorkerResources(num_cpus=0.0, num_gpus=r.resources.num_gpus)) for r in role_requests(cfg, plan)
    ]
    nodes = [{"GPU": float(cfg.cluster.gpus_per_node)}] * cfg.cluster.num_nodes
    try:
        check_node_placement(roles, nodes, placement_strategies(cfg, roles))
    except PlacementError as exc:
        return str(exc)
    return None


def private_cpus_problem(cfg: MasterConfig, plan: RunPlan) -> str | None:
    """A line when a one-node CPU run on a private local cluster (no cluster to join: no ``cluster.ray_address``, not a
    submitted job) reserves more CPUs than that cluster has (``cluster.num_cpus``, else this machine's cores, as
    :func:`~nemo_like.distributed.ray_init.local_init_kwargs` starts it): the run's capacity check refuses it once Ray
    has started. ``None`` when it fits, or for a recipe planned for a cluster (GPUs, several nodes, one to join: its
    CPUs are not known here)."""
    from nemo_like.distributed.ray_init import joins_existing_cluster

    if cfg.cluster.gpus_per_node or cfg.cluster.num_nodes > 1 or joins_existing_cluster(cfg.cluster):
        return None
    available = cfg.cluster.num_cpus or local_cores()
    roles = [(r.role, r.total().get("CPU", 0.0)) for r in role_requests(cfg, plan)]
    reserved = sum(cpus for _, cpus in roles)
    if reserved <= available + 1e-9:
        return None
    per_role = ", ".join(f"{role} {cpus:g}" for role, cpus in roles if cpus)
    return (
        f"the run's actors reserve {reserved:g} CPUs ({per_role}) but its private local cluster has {available:g} "
        f"(cluster.num_cpus, else this machine's cores): short by {reserved - available:g}"
    )


def _environment_sources(cfg: MasterConfig) -> list[tuple[str, str, str, dict, int, str | None, float]]:
    """``(where, role suffix, class, settings, actors, shared device, the actor's GPUs)`` of every environment the run
    loads: each task's, or each of a composite's sources (as the composite reads them; its actors each hold every
    source, those on a GPU placed as :func:`~nemo_like.environments.composite.place_sources` places them: ``<task>
    cuda:<i>``, one device a composite actor's sources there share; the actor reserves the GPUs it says). An agent
    task's environment is its verifier (``verifier_kwargs``: its settings), which its actors load."""
    out = []
    for task, section in cfg.env_sections.items():
        settings, kind = section.model_dump(by_alias=True), section.env_class or task
        workers = int(settings.get("num_workers") or 1)
        where = f"env.{task}"
        if kind == "agent" and settings.get("verifier"):
            where, kind, settings = f"{where}.verifier_kwargs", settings["verifier"], settings.get("verifier_kwargs") or {}
        if kind == "composite":
            sources = settings.get("sources") or {}
            placed, actor_gpus = source_placement(sources)
            for name, source in sources.items():
                source_kind, _, values = split_source(name, source)
                device = placed.get(name)
                shared = f"{task} {device}" if device and device != "cpu" else None
                out.append((f"{where}.sources.{name}", f"{task}.{name}", source_kind, values, workers, shared, actor_gpus))
        else:
            out.append((where, task, kind, settings, workers, None, 0.0))
    return out


def scorer_specs(cfg: MasterConfig) -> list[ScorerSpec | JudgeSpec]:
    """The models the run's environments load, for the memory plan: reward models
    (:func:`~nemo_like.plan.memory.scorer_memory`) and LLM judges (:func:`~nemo_like.plan.memory.judge_memory`)."""
    from nemo_like.environments.judge import JudgeEnvConfig
    from nemo_like.environments.reward_model import RewardModelEnvConfig

    specs: list[ScorerSpec | JudgeSpec] = []
    for _, suffix, kind, values, workers, shared, actor_gpus in _environment_sources(cfg):
        if kind == "reward_model":
            rm = RewardModelEnvConfig.model_validate({k: v for k, v in values.items() if k in RewardModelEnvConfig.model_fields})
            role = f"reward_model:{suffix}"
            specs.append(ScorerSpec(role, rm.model_name, rm.precision, workers, rm.num_gpus, rm.max_tokens_per_batch, shared, actor_gpus))
        elif kind == "judge":
            judge = JudgeEnvConfig.model_validate({k: v for k, v in values.items() if k in JudgeEnvConfig.model_fields})
            specs.append(judge_spec(cfg, f"judge:{suffix}", judge, workers))
    return specs


def judge_spec(cfg: MasterConfig, role: str, judge: Any, env_workers: int) -> JudgeSpec:
    """A judge's plan: ``env_workers`` environment actors, each starting ``num_engine_workers`` generation actors. Its
    longest sequence is ``engine_max_model_len``; else a vLLM engine's is the judge tokenizer's ``model_max_length``
    (what the engine is started with, :func:`~nemo_like.environments.judge.judge_context`: its KV budget must hold
    one), and the HF engine's, which holds only the prompts it gets, is estimated as the policy's whole sequence (the
    judge's template quotes its prompt and response) and the verdict."""
    context = how = None
    if judge.engine_max_model_len is not None:
        context, how = judge.engine_max_model_len, "engine_max_model_len"
    elif judge.engine_backend == "vllm":
        context = judge_tokenizer_context(judge)
        how = "the judge tokenizer's model_max_length, vLLM's max_model_len; engine_max_model_len lowers it"
    if context is None:
        context = cfg.policy.max_total_sequence_length + judge.max_new_tokens
        how = "estimated: the policy's max_total_sequence_length + the verdict's max_new_tokens; engine_max_model_len bounds it"
    return JudgeSpec(
        role, judge.model_name, judge.precision, env_workers * judge.num_engine_workers, judge.engine_num_gpus, judge.engine_backend,
        judge.max_batch_size, context, how, judge.engine_kv_cache_space_gib, judge.engine_gpu_memory_utilization,
    )  # fmt: skip


def judge_tokenizer_context(judge: Any) -> int | None:
    """The context a vLLM judge engine is started with when ``engine_max_model_len`` is null: its tokenizer's stated
    limit (None when it states none, or the tokenizer is not on this machine)."""
    from nemo_like.environments.judge import judge_context, loaded_tokenizer

    tokenizer = loaded_tokenizer(judge.model_name)
    return None if tokenizer is None else judge_context(judge, getattr(tokenizer, "model_max_length", None))


def required_resources(cfg: MasterConfig, plan: RunPlan) -> dict[str, float]:
    """The run's total request per resource: the roles' sum, at least what the recipe declares."""
    total = sum_resources(r.total() for r in role_requests(cfg, plan))
    for key, value in declared_resources(cfg).items():
        total[key] = max(total.get(key, 0.0), value)
    return total


def private_cluster_gpus(cluster: ClusterConfig, machine_gpus: float) -> float:
    """The GPUs a private local cluster started for ``cluster`` gets on a machine with ``machine_gpus``: what
    :func:`~nemo_like.distributed.ray_init.local_init_kwargs` hands ``ray.init`` (``None``: Ray counts the machine's
    visible GPUs; 0 when ``cluster.gpus_per_node`` is 0, whatever the machine has)."""
    from nemo_like.distributed.ray_init import local_init_kwargs

    num_gpus = local_init_kwargs(cluster)["num_gpus"]
    return float(machine_gpus if num_gpus is None else num_gpus)


def ensure_private_cluster_gpus(cfg: MasterConfig, plan: RunPlan, machine_gpus: float | None = None) -> None:
    """Before a private local cluster starts: a recipe asking for more GPUs than that cluster will get
    (:func:`private_cluster_gpus`: this machine's, none with ``cluster.gpus_per_node=0``) fails here, in seconds, with
    the message the post-start check would give. ``machine_gpus``: this machine's GPU count (default: torch's)."""
    from nemo_like.distributed.ray_init import joins_existing_cluster

    if joins_existing_cluster(cfg.cluster):
        return  # joining a cluster: only its own resources count (checked after init_ray)
    required = required_resources(cfg, plan)
    if not required.get("GPU"):
        return
    if machine_gpus is None:
        machine_gpus = _machine_gpus()
    gpus = private_cluster_gpus(cfg.cluster, machine_gpus)
    if required["GPU"] <= gpus:
        return
    available = {"CPU": float(cfg.cluster.num_cpus or local_cores()), "GPU": gpus}
    _check_against(cfg, plan, available, _private_hint(cfg, plan, machine_gpus))


def ensure_cluster_capacity(cfg: MasterConfig, plan: RunPlan, private_cluster: bool = False) -> None:
    """Check the run's request against the connected Ray cluster's total resources (call after ``init_ray``).

    ``private_cluster``: this run started its own local cluster, which has this machine's GPUs (none with
    ``cluster.gpus_per_node=0``)."""
    import ray

    nodes = [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]
    hint = _private_hint(cfg, plan) if private_cluster else ""
    _check_against(cfg, plan, ray.cluster_resources(), hint, nodes)


def _machine_gpus() -> float:
    """This machine's visible GPUs, as torch counts them."""
    import torch

    return float(torch.cuda.device_count())


def _private_hint(cfg: MasterConfig, plan: RunPlan, machine_gpus: float | None = None) -> str:
    """:func:`~nemo_like.distributed.capacity.private_cluster_hint` for this recipe: with ``cluster.gpus_per_node=0``,
    this machine's GPUs (``machine_gpus``, default: torch's count) that setting hides and the roles that ask for a GPU;
    else the running cluster's GPUs, or ``machine_gpus`` when given."""
    gpus_per_node = cfg.cluster.gpus_per_node
    if gpus_per_node == 0 and machine_gpus is None:
        machine_gpus = _machine_gpus()
    gpu_roles = [r.role for r in role_requests(cfg, plan) if r.count and r.bundle.get("GPU")]
    return private_cluster_hint(machine_gpus, gpus_per_node, gpu_roles)


def _check_against(
    cfg: MasterConfig, plan: RunPlan, available: dict[str, float], hint: str, nodes: list[dict[str, float]] | None = None
) -> None:
    """The run's request (per role, in total, as declared) against ``available`` and, when given, each role against the
    ``nodes`` (:func:`~nemo_like.distributed.capacity.check_node_placement`); :class:`PlacementError` if short."""
    roles = role_requests(cfg, plan)
    check_cluster_capacity(required_resources(cfg, plan), available, roles, declared_resources(cfg), hint)
    if nodes is not None:
        check_node_placement(roles, nodes, placement_strategies(cfg, roles))


def placement_strategies(cfg: MasterConfig, roles: list[RoleResources]) -> dict[str, str]:
    """The Ray placement strategy of each role's group: ``cluster.placement_strategy`` for the policy's groups (policy,
    reference, teachers: :class:`~nemo_like.models.policy.policy.Policy`), ``PACK`` for the others."""
    return {r.role: cfg.cluster.placement_strategy for r in roles if r.role.split(":")[0] in POLICY_ROLES}
