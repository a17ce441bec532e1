"""Driver-side facade over the trajectory collector and replay buffer actors (async GRPO).

The async loop talks to one :class:`AsyncRollouts`: ``take(step)`` waits for the step's groups,
``refit()`` pushes new weights to generation (waiting for the batch in flight, or in flight),
``paused(reason)`` holds generation for validation and checkpoints, ``checkpoint_state()`` is what a
checkpoint stores, ``shutdown()`` stops the actors.

A run with agent tasks runs the collector on a driver thread instead (:class:`DriverCollectorThread`): its batches are
agent sessions against the driver's rollout server (``docs/guides/agents.md``). Its refits (unless in flight) hold
the server's engine between two calls rather than waiting for the batch in flight, so a session may span a refit;
its rows count their age from the session's first call.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import ray
import torch

from nemo_like.data.prompts import DataExhausted, PromptDataLoader
from nemo_like.distributed import faults
from nemo_like.distributed.supervision import ActorRestartsExhausted, ledger
from nemo_like.distributed.worker_group import RayWorkerGroup, RoleResources, WorkerFailure, WorkerResources, get_with_context
from nemo_like.experience.replay_buffer import ReplayBufferActor, TrajectoryGroup, trajectory_ages
from nemo_like.experience.rollouts import Rollout, add_batch_counters
from nemo_like.experience.trajectory_collector import (
    AgentTrajectoryGroup,
    CollectorSettings,
    DriverTrajectoryCollector,
    GenerationStats,
    TrajectoryCollector,
)
from nemo_like.models.generation.interface import sampling_params
from nemo_like.models.loading import tokenizer_source
from nemo_like.models.policy.policy import Policy
from nemo_like.models.policy.sharded_logprobs import ShardedLogprobs
from nemo_like.utils.stop_signals import join_handling_signals

BUFFER_FILE = "replay_buffer.pt"
ASYNC_ACTOR_CPUS = 0.05  # the trajectory collector and the replay buffer mostly wait


def async_actor_resources(cfg: Any) -> list[RoleResources]:
    """The trajectory collector and the replay buffer: one actor each, a small CPU reservation and one thread
    (they only move samples; their torch ops are tiny, so an OpenMP team would only compete with training)."""
    resources = WorkerResources(num_cpus=ASYNC_ACTOR_CPUS, num_threads=1)
    return [RoleResources("trajectory_collector", 1, resources), RoleResources("replay_buffer", 1, resources)]


def replay_buffer_group(role: RoleResources, groups_per_step: int, max_age: int, placement_timeout_s: float) -> RayWorkerGroup:
    """The replay buffer's actor (``role``: :func:`async_actor_resources`'), threaded: the trainer's take waits while the
    collector's pushes proceed."""
    init = {"groups_per_step": groups_per_step, "max_age": max_age}
    return RayWorkerGroup("replay_buffer", ReplayBufferActor, role.count, role.resources, init, placement_timeout_s, max_concurrency=4)


@dataclass
class TakenRollout:
    """One step's data from the buffer, with how stale it is and how long the trainer waited for it."""

    rollout: Rollout
    ages: list[int]
    waited_s: float
    buffer_size: int  # groups left in the buffer (generated for later steps)


@dataclass
class RefitTiming:
    """Seconds of one async refit: the load itself, the trainer's wait for the batch in flight, and how
    long generation was held (in flight: the refit call's duration when a batch was generating, an upper bound, as
    the workers swap weights between two decoding steps; 0 when none was)."""

    refit: float
    trainer_waiting_for_refit: float
    generation_paused_for_refit: float


def rollout_from_groups(groups: list[TrajectoryGroup]) -> Rollout:
    """Concatenate groups into one prompt-major :class:`Rollout` (group ``i`` gets group id ``i``) with their batches'
    counters (``batch_metrics``). Groups of sessions (:class:`AgentTrajectoryGroup`) keep each row's session (numbered
    apart per group); beside them, a plain group's rows are a session each (a multi-turn batch a checkpoint saved
    before multi-turn rows had sessions)."""
    sizes = [len(g.samples) for g in groups]
    reference = [g.reference_logprobs for g in groups]
    session_of_row, env_metrics = None, {}
    if any(isinstance(g, AgentTrajectoryGroup) for g in groups):
        owners = [g.session_of_row if isinstance(g, AgentTrajectoryGroup) else list(range(len(g.samples))) for g in groups]
        stride = 1 + max((s for o in owners for s in o), default=0)  # group i's sessions: i * stride + s
        session_of_row = torch.tensor([i * stride + s for i, o in enumerate(owners) for s in o], dtype=torch.long)
    for g in groups:
        if g.batch_metrics:  # None: a group that is not its batch's first (or one a checkpoint saved before it had them)
            add_batch_counters(env_metrics, g.batch_metrics)
    return Rollout(
        prompts=[g.prompt for g, n in zip(groups, sizes) for _ in range(n)],
        group_ids=torch.arange(len(groups)).repeat_interleave(torch.tensor(sizes)),
        samples=[s for g in groups for s in g.samples],
        response_texts=[t for g in groups for t in g.response_texts],
        rewards=torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32),
        reference_logprobs=None if any(r is None for r in reference) else torch.cat(reference, dim=0),
        env_metrics=env_metrics,
        session_of_row=session_of_row,
    )


def reference_for_collector(parts: Any) -> ShardedLogprobs | None:
    """The reference workers, when the collector should run the reference pass on each batch it generates (off
    the trainer's path: the reference weights never change, so the result is the same whenever it runs). Not
    with LoRA: its reference is the policy's own workers, which are busy training."""
    if not parts.plan.logprobs.compute_reference or not isinstance(parts.reference, Policy):
        return None
    return parts.reference.logprob_client


class AsyncRollouts:
    """Starts the replay buffer and trajectory collector actors; see the module docstring."""

    def __init__(self, parts: Any, last_step: int, restored: dict[str, Any] | None = None) -> None:
        """``last_step``: the step training resumes after (0 for a fresh run); ``restored``: a checkpoint's
        ``{"buffer": ..., "next_target": ..., "unreported_generation": ...}`` (``parts.train_loader`` already holds its data position)."""
        cfg = parts.cfg
        async_cfg = cfg.grpo.async_grpo
        self.parts = parts
        self.in_flight = async_cfg.refits_mid_generation
        roles = {r.role: r for r in async_actor_resources(cfg)}
        timeout = cfg.cluster.placement_timeout_s
        self.buffer_group = replay_buffer_group(
            roles["replay_buffer"], cfg.grpo.num_prompts_per_step, async_cfg.max_trajectory_age_steps, timeout
        )
        self.buffer = self.buffer_group.workers[0]
        try:
            self._start_collector(parts, restored, last_step, roles, timeout)
        except BaseException:  # its placement group would stay reserved for the rest of the driver's Ray session
            self.buffer_group.kill()
            raise

    def _start_collector(self, parts: Any, restored: dict[str, Any] | None, last_step: int, roles: dict[str, Any], timeout: float) -> None:
        """Restore the buffer (when resuming) and start the trajectory collector: an actor, or a driver thread (agents)."""
        cfg = parts.cfg
        async_cfg = cfg.grpo.async_grpo
        if restored is not None:
            get_with_context(self.buffer.load_state_dict.remote(restored["buffer"]), "replay buffer: restore")
        loader = parts.train_loader
        settings = CollectorSettings(
            sampling=asdict(sampling_params(cfg)),
            num_generations=cfg.grpo.num_generations_per_prompt,
            seed=cfg.grpo.seed,
            max_age=async_cfg.max_trajectory_age_steps,
            last_step=cfg.grpo.max_num_steps,
            next_target=restored["next_target"] if restored is not None else last_step + 1,
            max_num_epochs=cfg.grpo.max_num_epochs,
            generation_version=parts.generation.weight_version,
            multi_turn=parts.plan.multi_turn,
            reference=reference_for_collector(parts),
            pad_token_id=parts.tokenizer.pad_token_id,
            in_flight_refits=async_cfg.refits_mid_generation,
            unreported=restored.get("unreported_generation") if restored is not None else None,
        )
        self.agents = getattr(parts, "agents", None)  # agent tasks: the collector runs on a driver thread
        self.local: DriverCollectorThread | None = None
        self._request_ref: ray.ObjectRef | None = None
        if self.agents is not None:
            own_loader = PromptDataLoader(loader.records, loader.batch_size, loader.seed, loader.shuffle)
            own_loader.load_state_dict(loader.state_dict())  # the collector's position, as the actor's
            collector = DriverTrajectoryCollector(parts.generation, parts.environment, self.buffer, parts.tokenizer, own_loader, settings)
            self.local = DriverCollectorThread(collector)
            return
        self.collector_group = RayWorkerGroup(
            "trajectory_collector",
            TrajectoryCollector,
            roles["trajectory_collector"].count,
            roles["trajectory_collector"].resources,
            dict(
                generation_workers=parts.generation.group.workers,
                environments=parts.environment,
                buffer=self.buffer,
                tokenizer_name=tokenizer_source(cfg.policy),  # made absolute, as every actor is given it
                records=loader.records,
                loader_args={"batch_size": loader.batch_size, "seed": loader.seed, "shuffle": loader.shuffle},
                loader_state=loader.state_dict(),
                settings=settings,
                fault_tolerance=cfg.cluster.fault_tolerance,
                armed_faults=faults.hand_over(("generation", "environment", "reference")),  # tests: the collector makes those calls
            ),
            timeout,
            max_concurrency=6,  # run, control calls, the driver's long poll for replacements and its answers
        )
        self.collector = self.collector_group.workers[0]
        self._run_ref = self.collector.run.remote()
        # A generation or environment actor dying under the collector's calls: the collector asks, the driver (which
        # owns the groups, the budgets and the served weights) replaces it while it waits on the collector.
        self._request_ref = self.collector.next_replacement_request.remote()

    # -- data -----------------------------------------------------------------------------------------
    def take(self, step: int, trainer_version: int) -> TakenRollout:
        """Wait for ``step``'s groups (raises :class:`DataExhausted` when the data ran out first)."""
        start = time.perf_counter()
        ref, what = self.buffer.take.remote(step, trainer_version), f"replay buffer: take step {step}"
        if not self._wait_for(ref, what):  # the collector's loop ended (crashed) before the step's data arrived
            self._raise_collector_failure(f"before producing step {step}'s data")
        try:
            groups, size = get_with_context(ref, what)
        except DataExhausted as exc:  # raised in the buffer's actor: Ray's error, its traceback for a message
            raise DataExhausted(str(getattr(exc, "cause", exc))) from None
        waited = time.perf_counter() - start
        return TakenRollout(rollout_from_groups(groups), trajectory_ages(groups, trainer_version), waited, size)

    # -- weights and pauses ---------------------------------------------------------------------------
    def needs_refit(self) -> bool:
        """Whether new weights would reach a batch the collector samples (see its ``needs_weights``)."""
        return bool(self._call("needs_weights"))

    def refit(self) -> RefitTiming:
        """Push the policy's new weights to generation (waiting for the batch in flight, or in flight). Generation
        gets the policy's exporter and calls it only when its transport uses the exported buckets."""
        policy, generation = self.parts.policy, self.parts.generation
        version = policy.weight_version
        if self.in_flight:
            generating = self._call("is_generating")
            seconds = generation.refit(policy.weight_buckets, version)
            generating = self._call("set_generation_version", version) or generating
            # Generation stood still only if a batch was generating: an idle collector's wait is waiting_for_pacing's
            return RefitTiming(seconds, 0.0, seconds if generating else 0.0)
        if self.agents is not None:  # between two engine calls: a session in flight goes on with the new weights
            gate = self.agents.engine
            waited = gate.hold()
            try:
                seconds = generation.refit(policy.weight_buckets, version)
            finally:
                held = gate.release()
            self._call("set_generation_version", version)
            return RefitTiming(seconds, waited, held)
        waited = self._call("pause", "refit", False)  # the batch's reference pass may still run: it needs no new weights
        seconds = generation.refit(policy.weight_buckets, version)
        held = self._call("resume", "refit", version)
        return RefitTiming(seconds, waited, held)

    @contextmanager
    def paused(self, reason: str, until_pushed: bool = True) -> Iterator[float]:
        """Hold generation between batches (for validation or a checkpoint); yields the seconds waited. ``until_pushed``:
        also until every generated batch is in the buffer (a checkpoint's; validation only needs the engine idle)."""
        waited = self._call("pause", reason, until_pushed)
        try:
            yield waited
        finally:
            self._call("resume", reason)

    def generation_stats(self) -> GenerationStats:
        """The collector's counters since the last call (its re-sent batches go into the run's fault counters)."""
        stats = self._call("take_stats")
        if stats.retried_batches or stats.seconds_lost:
            faults_ledger = ledger()
            faults_ledger.retried_batches += stats.retried_batches
            faults_ledger.seconds_lost += stats.seconds_lost
        return stats

    def checkpoint_state(self) -> tuple[dict[str, int], dict[str, Any], dict[str, Any]]:
        """``(loader state, JSON state, buffer contents)``; call inside ``paused(...)``."""
        collector = self._call("state_dict")
        buffer = get_with_context(self.buffer.state_dict.remote(), "replay buffer: state")
        # consumed_prompts (the collector's data position) counts the prompts read ahead: say how many still wait
        state = {
            "next_target": collector["pacer"]["next_target"],
            "buffered_prompts": len(buffer["groups"]),
            "unreported_generation": collector["unreported"],  # the counters of batches generated since the last step
        }
        return collector["loader"], {"async": state}, buffer

    def _call(self, method: str, *args: Any) -> Any:
        """A control call on the collector that fails (instead of hanging) if the collector's loop crashed."""
        if self.local is not None:
            try:
                return getattr(self.local.collector, method)(*args)
            except RuntimeError as exc:
                if self.local.collector.failure is None:
                    raise
                if isinstance(exc, WorkerFailure) and exc.role is not None:
                    raise  # a dead actor failed the collector: its role decides the run's restart (the loop may be busy)
                self.local.thread.join(5)  # the loop is ending: let it record what it raised
                self._raise_collector_failure(f"during '{method}'")
        ref, what = getattr(self.collector, method).remote(*args), f"trajectory collector: {method}"
        if not self._wait_for(ref, what):
            self._raise_collector_failure(f"during '{method}'")
        try:
            return get_with_context(ref, what)
        except ray.exceptions.RayTaskError as exc:
            raise_dead_worker(exc)
            raise

    def _wait_for(self, ref: ray.ObjectRef, what: str) -> bool:
        """Wait for ``ref``, replacing the actors the collector reports dead meanwhile; False when the collector's loop
        ended first. ``what`` (and ``started``) name the wait in a stall report (``watchdog.WAITING_CALLS``)."""
        started = time.monotonic()  # noqa: F841 (read from this frame by the stall watchdog)
        if self.local is not None:  # the driver's own objects replace dead actors: only the thread can end first
            while not ray.wait([ref], timeout=0.2)[0]:
                if not self.local.thread.is_alive():
                    return bool(ray.wait([ref], timeout=0)[0])
            return True
        while True:
            waiting = [ref, self._run_ref] + ([self._request_ref] if self._request_ref is not None else [])
            ready, _ = ray.wait(waiting, num_returns=1)
            if ref in ready:
                return True
            if self._run_ref in ready:
                return False
            self._replace_for_collector()

    def _replace_for_collector(self) -> None:
        """Serve the collector's request: replace the dead actor (the run's budgets apply) and send it the new handle."""
        request = get_with_context(self._request_ref, "trajectory collector: replacement request")
        self._request_ref = None if request is None else self.collector.next_replacement_request.remote()
        if request is None:  # the collector is stopping
            return
        if request["role"] == "generation":
            target = self.parts.generation.replaceable
        else:
            target = self.parts.environment.replaceable[request["task"]]
        current = target.group.workers[request["rank"]]
        try:
            if current._actor_id.hex() == request["dead"]:
                current = target.replace_dead(request["rank"], request["death"])
            # else: the driver's own call found it dead first and replaced it already
        except ActorRestartsExhausted as exc:
            self.collector.answer_replacement.remote(request["id"], None, str(exc))
            raise
        self.collector.answer_replacement.remote(request["id"], current, None)

    def _raise_collector_failure(self, when: str) -> None:
        """The collector's ``run()`` ended: raise a :class:`WorkerFailure` that says why, in one line."""
        error: BaseException | None
        if self.local is not None:
            error, stopped = self.local.error, self.local.collector.failure or "its loop returned"
        else:
            try:
                get_with_context(self._run_ref, "trajectory collector")
                error, stopped = None, "its loop returned"
            except WorkerFailure:
                raise
            except Exception as exc:  # noqa: BLE001 - a RayTaskError wrapping whatever the loop raised
                error = exc
        if error is None:
            raise WorkerFailure(f"the trajectory collector stopped {when}: {stopped}")
        if isinstance(error, WorkerFailure):
            raise error
        raise_dead_worker(error)
        raise WorkerFailure(f"the trajectory collector failed {when}: {loop_failure_cause(error)}") from error

    def shutdown(self) -> None:
        """Stop the loop and shut both actors down (an agent run: stop the collector's thread, cancelling the agent batch
        in flight, and give its agents' threads a moment to return; the rollout server stops with the run's parts).
        Inside :func:`~nemo_like.distributed.worker_group.reuse_actors` they are kept for the next run only when the loop
        ended cleanly: a loop that failed or did not stop in time may still push into the buffer."""
        ended = False
        try:
            if self.local is not None:
                self.local.stop(timeout_s=30)
                # A stop cancels the agent batch in flight without waiting for the pusher: a push still waiting for its
                # reference pass would land in the next run's buffer.
                ended = not self.local.thread.is_alive() and self.local.error is None and self.local.collector.pushing == 0
            else:
                self.collector.stop.remote()
                ended = _ended_cleanly(self._run_ref, timeout_s=30)
        finally:
            self.buffer.finish.remote("the run ended")  # a take the trainer left waiting returns
            groups = [self.buffer_group] if self.local is not None else [self.collector_group, self.buffer_group]
            for group in groups:
                if ended:
                    group.shutdown()
                else:
                    group.kill()


def _ended_cleanly(run_ref: ray.ObjectRef, timeout_s: float) -> bool:
    """Whether the collector's ``run`` call returned (not raised) within ``timeout_s``."""
    if not ray.wait([run_ref], timeout=timeout_s)[0]:
        return False
    try:
        ray.get(run_ref, timeout=0)
    except Exception:  # noqa: BLE001 - its failure was reported to the trainer already
        return False
    return True


def raise_dead_worker(error: BaseException) -> None:
    """Re-raise what the collector actor raised (``error``, a ``RayTaskError``) as the :class:`WorkerFailure` it
    wraps when that names a dead worker's role: the run restarts from its checkpoint on a dead reference worker
    (:func:`~nemo_like.algorithms.restarts.dead_role`) as a sync run does. Returns otherwise."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, WorkerFailure) and cause.role is not None:
        raise WorkerFailure(str(cause), cause.role, cause.actor_id) from error


def loop_failure_cause(error: BaseException) -> str:
    """One line for what the collector's loop raised: the last line of a multi-line error (a RayTaskError carries the
    traceback, its cause last), else the exception's type and message; then its notes (an environment's names its task:
    printed after the cause in the traceback, a note had taken the cause's place as the last line)."""
    notes = [n.strip() for n in getattr(getattr(error, "cause", None) or error, "__notes__", None) or [] if n.strip()]
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and line.strip() not in notes]
    cause = lines[-1] if len(lines) > 1 else f"{type(error).__name__}: {error}"
    return "; ".join([cause, *notes])


class DriverCollectorThread:
    """A :class:`DriverTrajectoryCollector`'s ``run()`` on a daemon thread of the driver; what it raised is kept in
    :attr:`error` (a stop's cancellation is not an error)."""

    def __init__(self, collector: DriverTrajectoryCollector) -> None:
        self.collector = collector
        self.error: BaseException | None = None
        self.result: dict[str, Any] | None = None
        self.thread = threading.Thread(target=self._run, name="trajectory-collector", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.collector.run()
        except BaseException as exc:  # noqa: BLE001 - reported by the trainer's next wait (AsyncRollouts)
            if not self.collector.stopping:
                self.error = exc

    def stop(self, timeout_s: float) -> None:
        """End the loop (cancelling an agent batch in flight), wait for the thread, and for the agents' threads briefly."""
        self.collector.stop()
        join_handling_signals(self.thread, timeout_s)
        agents = getattr(self.collector.environment, "agents", None)
        if agents is not None:
            left = agents.close()
            if left:
                print(f"[agent] {left} agent thread(s) still running at shutdown were left behind (daemon threads)", file=sys.stderr)
