"""How many torch/OpenMP threads each CPU-heavy actor gets: the automatic split of a node's CPUs.

The rule (:func:`split_threads`, a pure function) counts the actors whose work runs *at the same time*
on one node and gives each ``max(1, cpus // concurrent)`` threads. A step has three phases:

* generation: ``G`` generation workers;
* logprobs: the policy ranks ``P`` (only when the prev-logprob pass runs) and the reference ranks ``R``,
  concurrently (``start_logprob_passes``); ``R`` is 0 with LoRA, where the policy computes the reference logprobs
  with its adapters disabled and no reference actors start;
* training: the ``P`` policy ranks.

**sync** runs the phases one after the other, so an actor shares the node only with the other actors
of its own phase (each phase may use every core); an actor that takes part in several phases gets the
threads of its most crowded one. An idle actor's OpenMP threads go to sleep after a short spin
(libgomp's default wait policy), so the phases do not steal from each other.

**async** runs generation during every trainer phase: generation shares the node with the most
crowded trainer phase, and each trainer role with generation plus its own most crowded phase. With a
reference model of its own, the async collector runs the reference pass on each batch it generates, so
the reference ranks may run beside generation and any trainer phase: they count in every one.

An explicit count (``policy.num_threads_per_worker`` for the policy and reference ranks,
``policy.generation.num_threads_per_worker`` for the engine) is used as given; in async, an ``auto``
role then gets what the explicit one leaves: ``max(1, (cpus - threads in use by the other side) // its actors)``.

Actors of one group on one node (:func:`ranks_per_node`): with ``cluster.placement_strategy`` ``SPREAD`` or
``STRICT_SPREAD`` they spread evenly over ``cluster.num_nodes`` (``ceil(count / num_nodes)`` per node); with ``PACK``
(the default) or ``STRICT_PACK`` Ray fills one node before the next, so the split counts the worst case: as many as fit
on one node (``min(count, floor(node_cpus / policy.num_cpus_per_worker))``, and at most ``cluster.gpus_per_node`` on
GPU nodes), never fewer than the even spread.
The node's CPUs are read from the cluster once (:func:`nemo_like.distributed.threads.node_cpus`) and passed in;
the split is part of the run plan (:mod:`nemo_like.plan.run_plan`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nemo_like.plan.backend import GENERATION_ENGINES
from nemo_like.plan.logprob_passes import LogprobPlan

AUTO = "auto"


@dataclass(frozen=True)
class ThreadSplit:
    """Threads per actor of each role, and what they were derived from."""

    policy: int
    reference: int
    generation: int
    cpus: int
    async_mode: bool
    explicit: tuple[str, ...]  # roles whose count the user set
    teacher: int = 0  # threads per teacher rank (0: no teacher)
    # Sync runs with the prev pass: the policy ranks' threads in the logprob phase, where they share the node with the
    # reference's (and teachers') ranks; ``policy`` is then their count for training (and inline sampling), which runs
    # alone. 0: the same as ``policy``.
    policy_logprobs: int = 0
    inline: bool = False  # generation runs in the policy worker (its threads): no engine actor
    reference_actors: bool = True  # reference workers start (not with the KL penalty 0, nor with LoRA's own reference)

    def in_phase(self, role: str, phase: dict[str, int]) -> int:
        """Threads of one ``role`` actor in the trainer ``phase`` (:meth:`PhaseActors.trainer_phases`)."""
        if role == "policy" and len(phase) > 1 and self.policy_logprobs:
            return self.policy_logprobs
        return getattr(self, role)

    def describe(self, this_machine: bool = False) -> str:
        """One line for the start-up log; ``this_machine``: the CPUs were read on the machine that plans, not on a
        running cluster's nodes (``nemo-like plan``): the line says so."""

        def part(role: str, threads: int) -> str:
            how = "explicit" if role in self.explicit else "auto"
            if role == "policy" and self.policy_logprobs:
                return f"policy {threads} ({how}; {self.policy_logprobs} in the logprob phase, beside the frozen models' ranks)"
            if role == "generation" and self.inline:
                return "generation inline (in the policy worker, on its threads)"
            return f"{role} {threads} ({how})"

        names = ["policy", *(["reference"] if self.reference_actors else []), "generation", *(["teacher"] if self.teacher else [])]
        roles = ", ".join(part(r, getattr(self, r)) for r in names)
        mode = "async: generation and training share the cores" if self.async_mode else "sync: each phase may use every core"
        if this_machine:
            return f"threads per worker on {self.cpus} CPUs of this machine ({mode}): {roles}; a run splits its nodes' own CPUs"
        return f"threads per worker on {self.cpus} CPUs per node ({mode}): {roles}"


@dataclass(frozen=True)
class PhaseActors:
    """Actors of each role on one node, and whether the prev-logprob pass runs (then the policy ranks
    join the reference ranks in the logprob phase)."""

    policy: int
    reference: int
    generation: int
    prev_pass: bool = False
    reference_beside_training: bool = False  # async: the collector's reference pass may overlap any trainer phase
    teacher: int = 0  # teacher ranks (on-policy distillation): they run in the trainer's logprob phase

    def trainer_phases(self) -> list[dict[str, int]]:
        """Actors per role in each trainer phase (logprobs, training), roles that do not run left out."""
        teacher = (("teacher", self.teacher),)
        if self.reference_beside_training:  # the trainer's phases are the policy's (prev pass, training)
            return [{role: n for role, n in (("policy", self.policy), ("reference", self.reference), *teacher) if n}]
        logprobs = {role: n for role, n in (("policy", self.policy if self.prev_pass else 0), ("reference", self.reference), *teacher) if n}
        return [p for p in (logprobs, {"policy": self.policy}) if p]


def _busiest(phases: list[dict[str, int]], role: str | None = None) -> int:
    """Total actors of the most crowded phase (among those where ``role`` runs, when given)."""
    totals = [sum(p.values()) for p in phases if role is None or role in p]
    return max(totals, default=0)


def split_threads(
    cpus: int,
    actors: PhaseActors,
    async_mode: bool,
    policy_threads: int | None = None,
    generation_threads: int | None = None,
) -> ThreadSplit:
    """Threads per actor for each role (see the module docstring). ``policy_threads`` /
    ``generation_threads``: explicit counts (None: automatic); the reference follows the policy's."""
    if cpus < 1:
        raise ValueError(f"cpus must be >= 1, got {cpus}")
    phases = actors.trainer_phases()
    g = actors.generation

    def share(cpus_left: int, concurrent: int) -> int:
        return max(1, cpus_left // concurrent) if concurrent else max(1, cpus_left)

    auto: dict[str, int] = {}
    for role in ("policy", "reference", "teacher"):
        own = _busiest(phases, role)
        if not async_mode:
            # sync: the policy's training phase runs alone (its logprob phase's share is policy_logprobs below)
            auto[role] = share(cpus, actors.policy if role == "policy" else own)
        elif generation_threads is not None:
            auto[role] = share(cpus - g * generation_threads, own)
        else:
            auto[role] = share(cpus, g + own)
    if not async_mode:
        auto["generation"] = share(cpus, g)
    elif policy_threads is not None:
        auto["generation"] = share(cpus - _busiest(phases) * policy_threads, g)
    else:
        auto["generation"] = share(cpus, g + _busiest(phases))
    roles = [("policy", policy_threads), ("reference", policy_threads), ("generation", generation_threads)]
    if actors.teacher:
        roles.append(("teacher", policy_threads))
    explicit = tuple(r for r, v in roles if v)
    logprob_share = share(cpus, _busiest(phases[:1], "policy")) if not async_mode and actors.prev_pass else 0
    policy_logprobs = logprob_share if policy_threads is None and logprob_share and logprob_share != auto["policy"] else 0
    return ThreadSplit(
        policy=policy_threads or auto["policy"],
        reference=policy_threads or auto["reference"],
        generation=generation_threads or auto["generation"],
        cpus=cpus,
        async_mode=async_mode,
        explicit=explicit,
        teacher=(policy_threads or auto["teacher"]) if actors.teacher else 0,
        policy_logprobs=policy_logprobs,
        inline=actors.generation == 0,
        reference_actors=actors.reference > 0,
    )


def oversubscription(split: ThreadSplit, actors: PhaseActors) -> tuple[int, str] | None:
    """``(threads, where)`` of the most crowded set of concurrently running actors when their threads exceed
    the node's CPUs and some of them run more than one thread (single-threaded actors only take turns;
    multi-threaded OpenMP teams spin while they wait for each other); None otherwise."""
    worst: tuple[int, str] | None = None
    for phase in actors.trainer_phases():
        trainer = sum(n * split.in_phase(role, phase) for role, n in phase.items())
        widest = max(split.in_phase(role, phase) for role in phase)
        name = "+".join(phase)
        if split.async_mode and actors.generation:
            trainer += actors.generation * split.generation
            widest = max(widest, split.generation)
            name += "+generation"
        if trainer > split.cpus and widest > 1 and (worst is None or trainer > worst[0]):
            worst = (trainer, name)
    if not split.async_mode and actors.generation * split.generation > split.cpus and split.generation > 1:
        total = actors.generation * split.generation
        if worst is None or total > worst[0]:
            worst = (total, "generation")
    return worst


def per_node(count: int, num_nodes: int) -> int:
    """Actors of a role on one node when ``count`` of them spread evenly over ``num_nodes``."""
    return math.ceil(count / max(1, num_nodes))


PACKING_STRATEGIES = ("PACK", "STRICT_PACK")


def nodes_holding(count: int, on_one_node: int) -> int:
    """Nodes ``count`` actors of a role occupy with at most ``on_one_node`` on each (:func:`ranks_per_node`): on a CPU
    cluster, where a device is a node, the devices a phase of those ranks runs on (the MFU, the step estimate)."""
    return -(-count // max(1, on_one_node))


def ranks_per_node(count: int, num_nodes: int, strategy: str, fit: int) -> int:
    """The most of ``count`` actors (one bundle each) that may run on one node under the Ray placement ``strategy``:
    spread evenly for ``SPREAD`` / ``STRICT_SPREAD``; for ``PACK`` / ``STRICT_PACK``, whose bundles fill a node before
    the next, as many as ``fit`` (the bundles one node holds) allow, and never fewer than the even spread."""
    even = per_node(count, num_nodes)
    if strategy not in PACKING_STRATEGIES:
        return even
    return max(even, min(count, max(1, fit)))


def bundles_per_node(cfg: Any, cpus: int) -> int:
    """How many policy-sized bundles (``policy.num_cpus_per_worker`` CPUs, one GPU on GPU nodes) one node of ``cpus``
    CPUs holds."""
    fit = math.floor(cpus / cfg.policy.num_cpus_per_worker + 1e-9)
    if cfg.cluster.gpus_per_node:
        fit = min(fit, cfg.cluster.gpus_per_node)
    return max(1, fit)


def explicit_count(value: Any) -> int | None:
    """A config value (an int or ``"auto"``) as an explicit count, or None for automatic."""
    return None if value in (AUTO, None) else int(value)


def phase_actors(cfg: Any, logprobs: LogprobPlan, cpus: int, inline: bool = False, nodes: int | None = None) -> PhaseActors:
    """Actors of each role on one node of ``cpus`` CPUs (the most that may land there: :func:`ranks_per_node`) for the
    run ``cfg`` describes, with its decided logprob passes; ``inline``: the policy worker samples (no engine actor);
    ``nodes``: the nodes they can land on (default ``cluster.num_nodes``; a run passes its cluster's)."""
    strategy, fit = cfg.cluster.placement_strategy, bundles_per_node(cfg, cpus)
    nodes = cfg.cluster.num_nodes if nodes is None else nodes

    def on_one_node(count: int) -> int:
        return ranks_per_node(count, nodes, strategy, fit)

    ranks = cfg.policy.dp_size * cfg.policy.dtensor_cfg.tensor_parallel_size
    return PhaseActors(
        policy=on_one_node(ranks),
        reference=on_one_node(ranks) if logprobs.load_reference_model else 0,  # LoRA: the policy is the reference
        generation=0 if inline else on_one_node(GENERATION_ENGINES),
        prev_pass=logprobs.compute_prev,
        reference_beside_training=cfg.grpo.async_grpo.enabled and logprobs.load_reference_model,
        teacher=on_one_node(ranks * len(cfg.teacher.models())) if logprobs.compute_teacher else 0,
    )


def thread_split(cfg: Any, cpus: int, logprobs: LogprobPlan, inline: bool = False, nodes: int | None = None) -> ThreadSplit:
    """The run's split: ``cfg``'s explicit counts, its roles and mode, on ``cpus`` per node of ``nodes`` (default
    ``cluster.num_nodes``; ``inline``: no engine)."""
    return split_threads(
        cpus,
        phase_actors(cfg, logprobs, cpus, inline, nodes),
        cfg.grpo.async_grpo.enabled,
        explicit_count(cfg.policy.num_threads_per_worker),
        explicit_count(cfg.policy.generation.num_threads_per_worker),
    )


def node_count_warning(cfg: Any, nodes: int) -> str | None:
    """A warning when a CPU run's cluster has another number of nodes than ``cluster.num_nodes`` declares (``nodes``:
    the run plan's, the cluster's own): the run splits threads over the cluster's."""
    if cfg.cluster.gpus_per_node or nodes == cfg.cluster.num_nodes:
        return None
    return (
        f"cluster.num_nodes is {cfg.cluster.num_nodes}, but the Ray cluster has {nodes} node(s) with CPUs, any of which Ray "
        f"may place the actors on: the run plans for {nodes} (the thread split, the MFU's devices, the [plan] memory "
        f"lines); set cluster.num_nodes={nodes} (nemo-like plan takes the declared count)"
    )


def oversubscription_warning(cfg: Any, split: ThreadSplit, actors: PhaseActors) -> str | None:
    """A warning when the run's threads oversubscribe a node (CPU clusters only; see :func:`oversubscription`)."""
    if cfg.cluster.gpus_per_node:
        return None
    found = oversubscription(split, actors)
    if found is None:
        return None
    threads, where = found
    suggestion = split_threads(split.cpus, actors, split.async_mode)
    return (
        f"WARNING: {where} run at the same time with {threads} threads on {split.cpus} CPUs: oversubscribed threads spin "
        f"and can make a run several times slower (async measured 0.42x the sync speed on 2 cores); "
        f"leave policy.num_threads_per_worker and policy.generation.num_threads_per_worker at auto "
        f"(here: policy {suggestion.policy}, generation {suggestion.generation})"
    )


def shared_cores_warning(cfg: Any, split: ThreadSplit, actors: PhaseActors, others: list[str], trains: bool = True) -> str | None:
    """A warning when other nemo-like runs (``others``: one description each) are alive on the machine of a CPU run
    with an automatic thread count: ``auto`` gives this run every core of the node, as it gives the others, and their
    OpenMP teams spin against each other. It advises the counts ``auto`` would pick on the run's share of the cores
    (``trains`` False: ``nemo-like eval``, whose only workers are its engines)."""
    # inline: the policy worker samples on its threads
    roles = ["policy"] if split.inline else ["policy", "generation"] if trains else ["generation"]
    if cfg.cluster.gpus_per_node or not others or set(roles) <= set(split.explicit):
        return None
    share = split_threads(max(1, split.cpus // (len(others) + 1)), actors, split.async_mode)
    keys = {"policy": "policy.num_threads_per_worker", "generation": "policy.generation.num_threads_per_worker"}
    runs = "another nemo-like run is" if len(others) == 1 else f"{len(others)} other nemo-like runs are"
    return (
        f"{runs} alive on this machine ({'; '.join(others)}): with an automatic thread count each run takes all "
        f"{split.cpus} CPUs, and their threads spin against each other (two runs of the default recipe at once on 2 "
        "cores took 54 s, longer than one after the other, 48 s, and 32 s with one thread each: docs/guides/scaling.md); "
        "give each run its share: " + " ".join(f"{keys[r]}={getattr(share, r)}" for r in roles)
    )
