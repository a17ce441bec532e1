"""The run plan: every run-level decision, made once in setup and handed to the run's components.

:func:`decide_run_plan` is pure: it takes the validated config, the tokenizer's end-of-sequence ids and the CPUs of
a node, and returns a frozen :class:`RunPlan`. Setup calls it once the cluster is known (the thread split depends
on the node's CPUs), prints its ``[plan]`` lines, and passes the plan (or the part a component needs) down:

==================  ==================================================  =====================================
decision            consumers                                           decided by
==================  ==================================================  =====================================
logprob passes      which roles start; the step's passes                :func:`.logprob_passes.decide_logprob_passes`
generation backend  the engine factory (``models/engines.py``)          :func:`.backend.resolve_backend`
LoRA refit mode     the policy (what a refit sends)                     :func:`.refit.refit_mode`
thread split        every actor's thread count; the oversubscription    :func:`.threads.thread_split`
                    warning
CPU nodes           the thread split; the MFU's devices and the step     ``distributed.planning.plan_on_cluster``
                    estimate's on CPU (``policy_nodes``)
multi-turn          the rollout loops (sync, async collector, eval)     :func:`.multi_turn.multi_turn_settings`
scoring overlap     the sync step (score while logprob passes run)      ``MasterConfig.scoring_overlap_blocker``
agent tasks         setup (start the rollout server), the rollouts      :func:`agent_tasks`
policy forward      (decided by the policy worker from the loaded       ``PolicyWorker._choose_forward``
                    model; recorded here with :meth:`RunPlan.with_forward`)
==================  ==================================================  =====================================
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from nemo_like.config.errors import ConfigError
from nemo_like.plan.backend import PLAIN_MODEL, PolicyModel, check_backend_settings, resolve_backend
from nemo_like.plan.logprob_passes import LogprobPlan, decide_logprob_passes
from nemo_like.plan.multi_turn import MultiTurnSettings, multi_turn_settings
from nemo_like.plan.refit import merged_precision_warning, refit_mode
from nemo_like.plan.threads import PhaseActors, ThreadSplit, nodes_holding, oversubscription_warning, phase_actors, thread_split


@dataclass(frozen=True)
class Decision:
    """A decided value and the reason it was chosen (printed in the ``[plan]`` lines)."""

    value: str
    reason: str


@dataclass(frozen=True)
class RunPlan:
    """What a run does, decided once (see the module docstring for who decides and who reads each field)."""

    logprobs: LogprobPlan
    backend: Decision
    refit: Decision
    threads: ThreadSplit
    actors: PhaseActors  # actors of each role on one node (what the thread split was computed from)
    multi_turn: MultiTurnSettings | None
    overlap_scoring: bool  # the sync step scores while the logprob passes run
    nodes: int  # the nodes the thread split spread the actors over (on CPU: the cluster's own; see plan_on_cluster)
    policy_nodes: int  # the nodes the policy ranks span as the split places them (on CPU, the training phase's devices)
    oversubscription: str | None = None  # a warning when explicit thread counts oversubscribe a node
    forward: str | None = None  # the policy's logprob and training forward, as its workers chose it
    agent_tasks: tuple[str, ...] = ()  # env sections with class 'agent': rolled out by the user's agent over HTTP
    model: PolicyModel = PLAIN_MODEL  # what the backend and refit choices knew of the policy model
    refit_warning: str | None = None  # a merged LoRA refit in bf16 (refit.merged_precision_warning)
    async_staleness: str | None = None  # an async run: how old a sample may be and how refits meet the batch in flight
    # What ends a response: the eos ids (the tokenizer's and the generation config's) and policy.generation.stop_token_ids;
    # a saved policy's generation_config.json lists them (plain generate on the copy stops where the run did)
    end_of_response_ids: tuple[int, ...] = ()

    def with_forward(self, description: str) -> RunPlan:
        """This plan with the policy's forward recorded (the workers choose it from the loaded model)."""
        return replace(self, forward=description)

    def lines(self, this_machine: bool = False) -> list[str]:
        """The ``[plan]`` lines printed once at the start of a run (without the prefix); ``this_machine``: the thread
        split was computed from the planning machine's CPUs (``nemo-like plan``, before any cluster starts)."""
        out = list(self.logprobs.reasons)
        out.append(f"generation backend: {self.backend.value} ({self.backend.reason})")
        if self.refit.value != "full":
            out.append(f"LoRA refit: {self.refit.value} ({self.refit.reason})")
        if self.refit_warning:
            out.append(self.refit_warning)
        out.append(self.threads.describe(this_machine))
        if self.multi_turn is not None and not self.agent_tasks:  # an agent decides its session's calls
            ids = list(self.multi_turn.eos_token_ids) or "(the tokenizer's eos: not read here)"
            out.append(f"multi-turn: up to {self.multi_turn.max_turns} model turns per sample, end-of-turn ids {ids}")
        if self.overlap_scoring:
            out.append("scoring overlaps the logprob passes (grpo.overlap_scoring)")
        if self.forward is not None:
            out.append(f"policy logprob and training forward: {self.forward}")
        if self.oversubscription:
            out.append(self.oversubscription)
        if self.agent_tasks:
            out.append(f"agent tasks {list(self.agent_tasks)}: rolled out by their agents through a rollout server on 127.0.0.1")
        if self.async_staleness:
            out.append(self.async_staleness)
        return out


def decide_run_plan(
    cfg: Any,
    eos_token_ids: tuple[int, ...],
    cpus_per_node: int,
    with_policy: bool = True,
    nodes: int | None = None,
    model: PolicyModel = PLAIN_MODEL,
) -> RunPlan:
    """Every run-level decision for the validated config ``cfg``: ``eos_token_ids`` (the tokenizer's, for the turn
    loop), ``cpus_per_node`` (the smallest node's CPUs, read from the cluster once), ``nodes`` (how many nodes the
    actors can land on, read with them; default ``cluster.num_nodes``). ``with_policy=False``: a command
    without a trainable policy (``nemo-like eval``). Raises :class:`~nemo_like.config.errors.ConfigError` for a
    requested backend or LoRA refit mode the run cannot honour. ``model``: the policy model's facts
    (:class:`~nemo_like.plan.backend.PolicyModel`)."""
    logprobs = decide_logprob_passes(cfg)
    backend = Decision(*resolve_backend(cfg, with_policy, model))
    check_backend_settings(cfg, backend.value)
    refit = Decision(*refit_mode(cfg, backend.value, model)) if with_policy else Decision("full", "no trainable policy")
    inline = backend.value == "inline"
    nodes = cfg.cluster.num_nodes if nodes is None else nodes
    actors = phase_actors(cfg, logprobs, cpus_per_node, inline, nodes)
    threads = thread_split(cfg, cpus_per_node, logprobs, inline, nodes)
    return RunPlan(
        logprobs=logprobs,
        backend=backend,
        refit=refit,
        threads=threads,
        actors=actors,
        multi_turn=multi_turn_settings(cfg, eos_token_ids),
        overlap_scoring=bool(cfg.grpo.overlap_scoring) and cfg.scoring_overlap_blocker() is None,
        nodes=nodes,
        policy_nodes=nodes_holding(cfg.policy.dp_size * cfg.policy.dtensor_cfg.tensor_parallel_size, actors.policy),
        oversubscription=oversubscription_warning(cfg, threads, actors),
        agent_tasks=agent_tasks(cfg),
        model=model,
        refit_warning=merged_precision_warning(cfg, refit.value, model),
        end_of_response_ids=tuple(dict.fromkeys([*eos_token_ids, *(cfg.policy.generation.stop_token_ids or ())])),
        async_staleness=async_staleness(cfg.grpo.async_grpo),
    )


def async_staleness(async_cfg: Any) -> str | None:
    """An async run's staleness bound and refit mode, as its ``[plan]`` line says them; None for a sync run."""
    if not async_cfg.enabled:
        return None
    refits = "in flight (mid-sequence)" if async_cfg.refits_mid_generation else "wait for the batch in flight"
    return f"async: samples at most {async_cfg.max_trajectory_age_steps} update(s) old, refits {refits}"


def agent_tasks(cfg: Any) -> tuple[str, ...]:
    """The tasks whose environment is ``class: agent``. Every task of such a run must be an agent task (a batch is
    rolled out one way); sync and async runs alike (docs/guides/agents.md). Raises :class:`ConfigError` naming the
    keys otherwise."""
    tasks = cfg.agent_task_names()
    if not tasks:
        return ()
    others = sorted(set(cfg.env) - set(tasks))
    if others:
        raise ConfigError(
            f"env.{others[0]}: a run with agent tasks ({', '.join(tasks)}) cannot also have other tasks; expected only class: agent sections"
        )
    return tasks
