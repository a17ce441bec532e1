"""The trajectory collector: a Ray actor that keeps generating prompt batches while the policy trains.

Its :meth:`TrajectoryCollector.run` loop (the actor's long-running call) draws the next prompt batch,
asks the :class:`~nemo_like.experience.pacing.StalenessPacer` which training step will consume it,
generates and scores it on the generation and reward actors, and pushes its groups into the replay
buffer actor. With a KL penalty (and a reference model of its own) it also starts the reference
logprob pass on the batch and goes on to the next batch; a pusher thread waits for that pass and puts
the batch, with its reference logprobs, into the buffer (in order). The reference weights never change,
so the result is what the trainer's own pass would give, and the pass leaves the trainer's path.
Between batches it honours the driver's requests:

* ``pause(reason)`` returns once no batch is in flight (a refit waits for the batch's generation, a
  checkpoint also for its push into the buffer); ``resume(version)`` tells it the generation weights' version;
* ``set_generation_version(version)`` after an in-flight refit (generation never stopped);
* ``stop()`` ends the loop.

It is a threaded actor: those calls run while ``run`` is busy. It owns the training prompt loader,
so its position is the run's data position (saved in checkpoints while paused, when no batch is
half done).

A run with agent tasks runs the same loop on a driver thread (:class:`DriverTrajectoryCollector`): its batches are
agent sessions against the driver's rollout server, and its groups carry each row's session and the batch's
``agent/*`` counters (:class:`AgentTrajectoryGroup`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import ray
import torch

from nemo_like.data.collate import collate_samples
from nemo_like.data.prompts import PromptDataLoader, PromptRecord
from nemo_like.distributed import faults
from nemo_like.distributed.reinit import Reinitializable
from nemo_like.distributed.supervision import ActorRestartsExhausted, Death, begin_run, ledger
from nemo_like.distributed.worker_group import WorkerFailure, summed_over_workers
from nemo_like.environments.worker import EnvironmentHandles
from nemo_like.experience.pacing import StalenessPacer
from nemo_like.experience.replay_buffer import TrajectoryGroup
from nemo_like.experience.rollouts import Rollout, collect_rollout
from nemo_like.models.generation.interface import GeneratedSample, SamplingParams, generate_on_group
from nemo_like.models.loading import load_tokenizer
from nemo_like.models.policy.sharded_logprobs import ShardedLogprobs
from nemo_like.plan.multi_turn import MultiTurnSettings
from nemo_like.utils.counters import Increments
from nemo_like.utils.run_control import run_control
from nemo_like.utils.seeds import rollout_seed
from nemo_like.utils.stop_signals import wait_for_handling_signals


@dataclass
class GenerationStats:
    """What the collector did since the driver last asked (seconds, tokens, batches)."""

    generation_seconds: float = 0.0
    reward_seconds: float = 0.0
    reference_seconds: float = 0.0  # reference logprob passes run on the generated batches
    reference_passes: float = 0.0  # their forward passes (micro-batches, summed over the reference workers)
    reference_tokens: float = 0.0  # the prompt + response tokens they scored (performance/num_reference_tokens)
    generated_tokens: float = 0.0
    batches: int = 0
    waiting_for_pacing: float = 0.0  # held by the staleness bound
    paused_for_refit: float = 0.0
    paused_for_checkpoint: float = 0.0
    paused_for_validation: float = 0.0
    retried_batches: int = 0  # batches whose calls were re-sent to a replaced actor (faults/retried_batches)
    seconds_lost: float = 0.0  # and the seconds that cost (faults/seconds_lost)

    @classmethod
    def restored(cls, saved: dict[str, Any] | None) -> GenerationStats:
        """The counters a checkpoint saved (``unreported_generation``); keys of earlier versions are dropped (an
        ``env_counters`` of the batches since the last step: the batches' counters now travel with their groups)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (saved or {}).items() if k in known})

    def add_pause(self, reason: str, seconds: float) -> None:
        name = f"paused_for_{reason}"
        if hasattr(self, name):
            setattr(self, name, getattr(self, name) + seconds)


class ActorHandles:
    """Actor handles that quack like a :class:`~nemo_like.distributed.worker_group.RayWorkerGroup`
    (``workers``, ``len``) so the rollout helpers run unchanged inside another actor. ``target``: who replaces a
    dead one (:class:`DriverReplaced`; ``None``: a death is an error)."""

    def __init__(self, workers: list[Any], name: str = "generation") -> None:
        self.workers = list(workers)
        self.name = name
        self.target: DriverReplaced | None = None

    def __len__(self) -> int:
        return len(self.workers)

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[GeneratedSample]:
        return generate_on_group(self, prompts, params, seed, self.target)

    def mid_generation_seconds(self) -> float:
        """Seconds the workers' generate calls spent loading in-flight refits, summed over the workers."""
        return summed_over_workers(self.workers, "mid_generation_seconds", "generation: counters")


class DriverReplaced:
    """Inside the collector, a role's actors (``group``: their handles, updated in place) whose dead actor the driver
    replaces: it owns the groups, the budgets and the served weights (:mod:`nemo_like.distributed.supervision`). It
    stands where a :class:`~nemo_like.distributed.supervision.Replaceable` stands in the driver."""

    def __init__(self, collector: TrajectoryCollector, role: str, group: Any, task: str | None = None) -> None:
        self.collector, self.role, self.group, self.task = collector, role, group, task

    def describe(self, rank: int) -> str:
        actor_id = getattr(self.group.workers[rank], "_actor_id", None)
        return f"{self.group.name} rank {rank} (actor {actor_id.hex()[:12] if actor_id is not None else '?'})"

    def replace_dead(self, rank: int, death: Death) -> Any:
        dead = self.group.workers[rank]._actor_id.hex()
        self.group.workers[rank] = self.collector.request_replacement(self.role, self.task, rank, death, dead)
        return self.group.workers[rank]


class EnvironmentGroup:
    """One task's environment actors inside the collector (the handles' own list, so a replacement shows there)."""

    def __init__(self, task: str, workers: list[Any]) -> None:
        self.name, self.workers = f"environment:{task}", workers


@dataclass
class AgentTrajectoryGroup(TrajectoryGroup):
    """One prompt's sessions (agent or multi-turn tasks): ``session_of_row[i]`` is the session (its index in the batch)
    of sample ``i`` (a branched session has several rows and weighs once in its group's baseline)."""

    session_of_row: list[int] = field(default_factory=list)


def split_into_groups(rollout: Rollout, target_step: int, reference_logprobs: torch.Tensor | None = None) -> list[TrajectoryGroup]:
    """One :class:`TrajectoryGroup` per prompt of a prompt-major rollout (with its rows of ``reference_logprobs``); a
    batch of sessions' (``rollout.session_of_row`` set: agent and multi-turn tasks) are :class:`AgentTrajectoryGroup` s."""
    groups: dict[int, list[int]] = defaultdict(list)
    for index, group_id in enumerate(rollout.group_ids.tolist()):
        groups[group_id].append(index)
    out: list[TrajectoryGroup] = []
    for _, rows in sorted(groups.items()):
        fields = dict(
            target_step=target_step,
            prompt=rollout.prompts[rows[0]],
            samples=[rollout.samples[i] for i in rows],
            response_texts=[rollout.response_texts[i] for i in rows],
            rewards=[float(rollout.rewards[i]) for i in rows],
            reference_logprobs=None if reference_logprobs is None else reference_logprobs[rows],
        )
        if rollout.session_of_row is None:
            out.append(TrajectoryGroup(**fields))
        else:
            out.append(AgentTrajectoryGroup(**fields, session_of_row=[int(rollout.session_of_row[i]) for i in rows]))
    return out


def agent_batch_counters(rollout: Rollout) -> dict[str, float]:
    """An agent batch's counters (its ``agent/*`` ones and the verifier's ``env/<task>/...``), plus
    ``agent/sessions_across_refits``: sessions whose calls were sampled by more than one weight version (a refit
    landed between two of their calls, or inside one with in-flight updates)."""
    owners = rollout.session_of_row.tolist() if rollout.session_of_row is not None else []
    spanning = {o for o, s in zip(owners, rollout.samples) if s.refitted_mid_sequence}
    return {**rollout.env_metrics, "agent/sessions_across_refits": float(len(spanning))}


@dataclass(frozen=True)
class CollectorSettings:
    """What the collector's loop is told once, wherever it runs (a Ray actor, or a driver thread)."""

    sampling: dict[str, Any]  # SamplingParams' fields
    num_generations: int
    seed: int
    max_age: int  # grpo.async_grpo.max_trajectory_age_steps
    last_step: int
    next_target: int  # the first step to generate for (a resumed run: the checkpoint's)
    max_num_epochs: int
    generation_version: int  # the engines' weight version at the start
    multi_turn: MultiTurnSettings | None = None
    reference: ShardedLogprobs | None = None  # set: every batch goes into the buffer with its reference logprobs
    pad_token_id: int = 0
    in_flight_refits: bool = False  # refits load inside generate calls: their load time is taken out of generation's
    unreported: dict[str, Any] | None = None  # a resumed run: the counters its checkpoint's collector had not reported


class TrajectoryCollector(Reinitializable):
    """See the module docstring. Construct through Ray with ``max_concurrency >= 3``. Kept between the runs of one
    driver (:func:`~nemo_like.distributed.worker_group.reuse_actors`) once its loop has ended cleanly: re-initialised as
    a fresh one (its fault budget, armed faults, loader and counters made anew)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        generation_workers: list[Any],
        environments: EnvironmentHandles,
        buffer: Any,
        tokenizer_name: str,
        records: list[PromptRecord],
        loader_args: dict[str, Any],
        loader_state: dict[str, int] | None,
        settings: CollectorSettings,
        fault_tolerance: Any = None,
        armed_faults: list[Any] | None = None,
    ) -> None:
        begin_run(fault_tolerance)  # this process's call deadline and its re-send counters (reported with the stats)
        faults.arm_specs(armed_faults or [])  # tests: the generation and environment faults fire here, by batch target step
        generation = ActorHandles(generation_workers)
        generation.target = DriverReplaced(self, "generation", generation)
        environments.replaceable = {
            task: DriverReplaced(self, "environment", EnvironmentGroup(task, workers), task)
            for task, workers in environments.workers.items()
        }
        loader = PromptDataLoader(records, **loader_args)
        if loader_state is not None:
            loader.load_state_dict(loader_state)
        self._setup(generation, environments, buffer, load_tokenizer(tokenizer_name), loader, settings)

    def _setup(
        self,
        generation: Any,
        environments: EnvironmentHandles,
        buffer: Any,
        tokenizer: Any,
        loader: PromptDataLoader,
        settings: CollectorSettings,
    ) -> None:
        """The state of the loop, wherever it runs (a Ray actor, or a driver thread: :class:`DriverTrajectoryCollector`)."""
        self.generation = generation
        self.environment = environments
        self.buffer = buffer
        self.tokenizer = tokenizer
        self.loader = loader
        self.params = SamplingParams(**settings.sampling)
        self.num_generations = settings.num_generations
        self.seed = settings.seed
        self.pacer = StalenessPacer(settings.max_age, settings.last_step, settings.next_target)
        self.max_num_epochs = settings.max_num_epochs
        self.version = settings.generation_version
        self.multi_turn = settings.multi_turn  # a batch's turns all run inside the batch: a checkpoint never splits one
        self.in_flight_refits = settings.in_flight_refits
        self._loads_seen = 0.0  # generation's mid_generation_seconds after the last batch
        self.reference = settings.reference  # when set, every batch goes into the buffer with its reference logprobs
        self.pad_token_id = settings.pad_token_id
        self.reference_passes = Increments()
        self.cond = threading.Condition()
        self.pause_reasons: set[str] = set()
        self.paused = False
        self.in_flight = False  # a batch is generating
        self.pushing = 0  # generated batches whose reference pass runs; the pusher puts them into the buffer in order
        self.pusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="collector-push")
        self.stopping = False
        self.exhausted = False
        self.failure: str | None = None
        self.failed_worker: tuple[str | None, str | None] = (None, None)  # (role, actor id) of a dead actor that failed it
        self.stats = GenerationStats.restored(settings.unreported)
        self._pause_started: dict[str, tuple[float, bool, bool]] = {}  # reason -> (since, nothing left, held by the bound)
        # Dead actors: requests to the driver (``next_replacement_request``) and its answers (``answer_replacement``).
        self.replacements = threading.Condition()
        self.requests: list[dict[str, Any]] = []
        self.answers: dict[int, tuple[Any, str | None]] = {}
        self._request_ids = itertools.count()

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Generate batches until :meth:`stop`; returns the final counters."""
        while True:
            target = self._wait_for_next_target()
            if target is None:
                self.pusher.shutdown(wait=True)  # every generated batch is in the buffer before the loop ends
                return {"batches": self.stats.batches, "next_target": self.pacer.next_target}
            try:
                self._generate_batch(target)
            except BaseException as exc:
                with self.cond:
                    self._record_failure(exc)
                raise
            finally:
                with self.cond:
                    self.in_flight = False
                    self.cond.notify_all()

    def _record_failure(self, exc: BaseException) -> None:
        """Keep why the loop or the pusher failed (under ``cond``), and the dead actor's role and id when a worker died,
        so the trainer's run restarts as a sync run does (a dead reference worker stopped an async run)."""
        self.failure = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, WorkerFailure):
            self.failed_worker = (exc.role, exc.actor_id)

    def _failure_error(self) -> WorkerFailure:
        """The error a caller gets once the collector failed: a :class:`WorkerFailure` naming the dead actor's role."""
        return WorkerFailure(f"the trajectory collector failed: {self.failure}", *self.failed_worker)

    def _wait_for_next_target(self) -> int | None:
        """Block until a batch may start (not paused, within the age bound); ``None`` once stopped."""
        with self.cond:
            while True:
                if self.failure is not None:  # the pusher failed
                    raise self._failure_error()
                if self.stopping:
                    return None
                if self.pause_reasons:
                    if not self.paused:
                        self.paused = True
                        self.cond.notify_all()
                    self.cond.wait()
                    continue
                self.paused = False
                if not self.exhausted and not self.pacer.done and self.loader.next_batch_epoch >= self.max_num_epochs:
                    # "No more groups" is true once the pushes in flight land. A failed push, a stop or a pause that
                    # arrives meanwhile is handled first (the loop checks them again): marking the data exhausted
                    # then would report a lost batch as the data's end, and wait past the pause's one notify.
                    self.cond.wait_for(lambda: self.pushing == 0 or self._interrupted())
                    if self.pushing or self._interrupted():
                        continue
                    self.exhausted = True
                    ray.get(self.buffer.finish.remote(f"grpo.max_num_epochs={self.max_num_epochs} reached"))
                target = None if self.exhausted else self.pacer.reserve(self.version)
                if target is not None:
                    self.in_flight = True
                    return target
                held_by_bound = not self.pacer.done and not self.exhausted  # else: nothing left to generate
                waited_from = time.perf_counter()
                self.cond.wait()
                if held_by_bound:
                    self.stats.waiting_for_pacing += time.perf_counter() - waited_from

    def _generate_batch(self, target: int) -> None:
        prompts = self.loader.next_batch()
        self._mark_step(target)
        timings: dict[str, float] = {}
        rollout = collect_rollout(
            self.generation,
            self.environment,
            self.tokenizer,
            prompts,
            self.num_generations,
            self.params,
            seed=rollout_seed(self.seed, target),
            timings=timings,
            multi_turn=self.multi_turn,
        )
        # Refit time inside the batch's generation (idle/generation_paused_for_refit's): a running total, whose growth
        # is this batch's (a replaced worker starts again from 0).
        loads = self._refit_seconds_in_generation()
        timings["generation"] -= max(loads - self._loads_seen, 0.0)
        self._loads_seen = loads
        reference_refs = None
        started = time.perf_counter()
        if self.reference is not None:  # collated as the trainer will collate the step's batch: same rows, same width
            reference_refs = self.reference.start(collate_samples(rollout.samples, self.pad_token_id))
        with self.cond:
            self.pushing += 1
        # The reference pass runs while the next batch generates; one pusher thread keeps the buffer FIFO.
        self.pusher.submit(self._push, rollout, target, reference_refs, started, timings)

    def _refit_seconds_in_generation(self) -> float:
        """Running total of the seconds refits took inside this collector's generate calls: in-flight refits' weight
        loads on the generating thread (mid-sequence, or as a call ends); 0 with the waiting refit, which pauses the
        loop between batches."""
        return self.generation.mid_generation_seconds() if self.in_flight_refits else 0.0

    def _batch_counters(self, rollout: Rollout) -> dict[str, float]:
        """The counters a batch's step reports: its environments'."""
        return dict(rollout.env_metrics)

    def _mark_step(self, target: int) -> None:
        """This process's step: the one its batch is for (fault injection, deaths' reports)."""
        run_control().step = target

    def _push(self, rollout: Rollout, target: int, reference_refs: list[Any] | None, started: float, timings: dict[str, float]) -> None:
        """Wait for the batch's reference pass (if any) and put its groups into the buffer."""
        try:
            reference, reference_seconds, reference_passes, reference_tokens = None, 0.0, 0, 0.0
            if reference_refs is not None:
                reference = self.reference.gather(reference_refs, "reference logprobs (trajectory collector)")
                reference_seconds = time.perf_counter() - started
                # Only this thread uses the reference actors in an async run, so the growth is this batch's passes.
                reference_passes = self.reference_passes.take(self.reference.forward_pass_counts()["logprobs"])
                reference_tokens = float(sum(len(s.prompt_ids) + len(s.response_ids) for s in rollout.samples))
            groups = split_into_groups(rollout, target, reference)
            groups[0].batch_metrics = self._batch_counters(rollout)
            ray.get(self.buffer.push.remote(groups))
        except BaseException as exc:
            with self.cond:
                self._record_failure(exc)
                self.pushing -= 1
                self.cond.notify_all()
            raise
        with self.cond:
            self.pushing -= 1
            self.stats.generation_seconds += timings["generation"]
            self.stats.reward_seconds += timings["reward"]
            self.stats.reference_seconds += reference_seconds
            self.stats.reference_passes += reference_passes
            self.stats.reference_tokens += reference_tokens
            self.stats.generated_tokens += rollout.decoded_tokens
            self.stats.batches += 1
            self.cond.notify_all()

    # -- control (called by the driver while run() is busy) ---------------------------------------------
    def _nothing_left_to_generate(self) -> bool:
        """Every step's batch is generated, or the data is spent (call with ``cond`` held)."""
        return self.stopping or self.exhausted or self.pacer.done or self.loader.next_batch_epoch >= self.max_num_epochs

    def _interrupted(self) -> bool:
        """A failed push, a stop or a pause is waiting for the loop (call with ``cond`` held)."""
        return self.failure is not None or self.stopping or bool(self.pause_reasons)

    def pause(self, reason: str, until_pushed: bool = True) -> float:
        """Hold the loop between batches; returns the seconds spent waiting for the batch in flight.
        ``until_pushed``: also wait until every generated batch is in the buffer (a checkpoint needs that; a
        refit only needs generation to stand still)."""
        start = time.perf_counter()

        def held() -> bool:
            return not self.in_flight and (self.paused or self.stopping) and (not until_pushed or self.pushing == 0)

        with self.cond:
            self.pause_reasons.add(reason)
            self.cond.notify_all()
            # the driver's main thread where the collector is the driver's (agent tasks): up to an agent batch's deadline_s
            wait_for_handling_signals(self.cond, lambda: self.failure is not None or held())
            if self.failure is not None:
                raise self._failure_error()
            idle = self._nothing_left_to_generate()
            bound = not idle and not self.pacer.can_start(self.version)  # waiting for exactly the weights this brings
            self._pause_started[reason] = (time.perf_counter(), idle, bound)
        return time.perf_counter() - start

    def resume(self, reason: str, generation_version: int | None = None) -> float:
        """Release a :meth:`pause`; returns the seconds generation was held for ``reason``: 0 when the loop had nothing
        left to generate (the data or the steps were spent) or was already held by the staleness bound (that wait is
        ``waiting_for_pacing``'s, as on the in-flight and agent paths), so nothing more was held."""
        with self.cond:
            started, idle, bound = self._pause_started.pop(reason)
            elapsed = time.perf_counter() - started
            if bound:
                self.stats.waiting_for_pacing += elapsed
            held = 0.0 if idle or bound else elapsed
            self.stats.add_pause(reason, held)
            self.pause_reasons.discard(reason)
            if generation_version is not None:
                self.version = generation_version
            self.cond.notify_all()
            return held

    def set_generation_version(self, generation_version: int) -> bool:
        """The generation weights changed without a pause (in-flight refit); returns whether a batch is generating."""
        with self.cond:
            self.version = generation_version
            self.cond.notify_all()
            return self.in_flight

    def needs_weights(self) -> bool:
        """Whether new weights would reach a batch: more are to come, or one is generating and a refit reaches it
        (:meth:`_refits_reach_the_running_batch`). The last refits of a run would otherwise push weights nothing samples
        with, a waiting refit after waiting for the last batch to end."""
        with self.cond:
            return (self.in_flight and self._refits_reach_the_running_batch()) or not self._nothing_left_to_generate()

    def _refits_reach_the_running_batch(self) -> bool:
        """In-flight refits load inside the batch's generate calls; a waiting refit waits for the batch to end."""
        return self.in_flight_refits

    def is_generating(self) -> bool:
        """Whether a batch is generating now (an in-flight refit then swaps its weights between two decoding steps)."""
        with self.cond:
            return self.in_flight

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        with self.replacements:
            self.replacements.notify_all()

    # -- dead actors: the driver replaces them (it owns the groups, the budgets and the weights) ------------------
    def request_replacement(self, role: str, task: str | None, rank: int, death: Death, dead_actor: str) -> Any:
        """Called by the loop's thread: ask the driver for a replacement of a dead actor; returns its handle."""
        with self.replacements:
            request_id = next(self._request_ids)
            self.requests.append({"id": request_id, "role": role, "task": task, "rank": rank, "death": death, "dead": dead_actor})
            self.replacements.notify_all()
            self.replacements.wait_for(lambda: request_id in self.answers or self.stopping)
            if request_id not in self.answers:
                raise RuntimeError(f"the run stopped while {death.actor} was being replaced")
            handle, error = self.answers.pop(request_id)
        if error is not None:
            raise ActorRestartsExhausted(error)
        return handle

    def next_replacement_request(self) -> dict[str, Any] | None:
        """The driver's long poll: the next replacement request (``None`` once stopping)."""
        with self.replacements:
            self.replacements.wait_for(lambda: bool(self.requests) or self.stopping)
            return self.requests.pop(0) if self.requests else None

    def answer_replacement(self, request_id: int, handle: Any, error: str | None = None) -> None:
        """The driver's answer: the replacement's handle, or why there is none (the run stops)."""
        with self.replacements:
            self.answers[request_id] = (handle, error)
            self.replacements.notify_all()

    # -- reporting and state ----------------------------------------------------------------------------
    def take_stats(self) -> GenerationStats:
        """Counters accumulated since the last call, then reset."""
        with self.cond:
            stats, self.stats = self.stats, GenerationStats()
            faults = ledger()  # re-sends of this process's calls since the last call
            stats.retried_batches, stats.seconds_lost = faults.retried_batches, faults.seconds_lost
            faults.retried_batches, faults.seconds_lost = 0, 0.0
            return stats

    def state_dict(self) -> dict[str, Any]:
        """Loader position, next target and the counters not yet reported (of batches the buffer holds: a resumed
        run's first step reports them, as the step after the save does); only meaningful while paused (no batch half
        done)."""
        with self.cond:
            if self.in_flight or self.pushing:
                raise RuntimeError("collector state requested while a batch is in flight; pause it first")
            unreported = {k: v for k, v in asdict(self.stats).items() if k not in ("retried_batches", "seconds_lost")}
            return {"loader": self.loader.state_dict(), "pacer": self.pacer.state_dict(), "unreported": unreported}


class DriverTrajectoryCollector(TrajectoryCollector):
    """The collector of a run with agent tasks, run by :class:`~nemo_like.experience.async_rollouts.AsyncRollouts` on
    a driver thread. The agent functions and the rollout server live in the driver (``docs/guides/agents.md``), so
    its batches are the driver's :class:`~nemo_like.experience.agent_rollouts.AgentRollouts` batches (``environments``
    is the run's :class:`~nemo_like.experience.agent_rollouts.AgentHandles`), and its calls go through the driver's
    own generation and environment objects (a dead actor is replaced in place, as in a sync run). Same loop, pacing,
    buffer and control calls as the actor; a refit does not pause it but holds the server's engine between two calls
    (:class:`~nemo_like.experience.agent_rollouts.EngineGate`)."""

    # Built from the driver's own objects: only the loop's state (the actor's __init__ builds those objects from names).
    __init__ = TrajectoryCollector._setup

    def _batch_counters(self, rollout: Rollout) -> dict[str, float]:
        """An agent batch's: :func:`agent_batch_counters` (a batch of tasks no agent serves: its environments')."""
        return agent_batch_counters(rollout) if rollout.session_of_row is not None else super()._batch_counters(rollout)

    def _mark_step(self, target: int) -> None:
        """Nothing: in the driver, the run control's step is the trainer's."""

    def _refits_reach_the_running_batch(self) -> bool:
        """Always: a refit holds the server's engine between two calls of the running batch's sessions."""
        return True

    def _refit_seconds_in_generation(self) -> float:
        """Also the seconds the agents' engine calls waited at the gate a waiting refit held (inside the batch)."""
        agents = getattr(self.environment, "agents", None)
        held = getattr(getattr(agents, "engine", None), "held_seconds", 0.0)  # the EngineGate a waiting refit holds
        return super()._refit_seconds_in_generation() + held

    def run(self) -> dict[str, Any]:
        try:
            return super().run()
        except BaseException as exc:
            with self.cond:  # a control call waiting on the loop (pause) fails instead of hanging
                if self.failure is None:
                    self._record_failure(exc)
                self.cond.notify_all()
            raise
        finally:
            self.pusher.shutdown(wait=False, cancel_futures=True)

    def stop(self) -> None:
        """End the loop and cancel the agent batch in flight (its sessions end; its agents' next calls are refused)."""
        super().stop()
        agents = getattr(self.environment, "agents", None)
        if agents is not None:
            agents.cancel()

    def take_stats(self) -> GenerationStats:
        """Counters since the last call (the re-sends of this thread's calls are already in the driver's ledger)."""
        with self.cond:
            stats, self.stats = self.stats, GenerationStats()
            return stats
