"""The trajectory collector's loop when the data runs out while its last batch is still being pushed (its reference
pass running): a pause or a stop that arrives then is served, and a push that fails is a failure, not the data's end.
The real loop (through :class:`DriverTrajectoryCollector`, the same loop the actor runs), the real replay buffer actor
and data loader; the engine and the reference pass are small stand-ins (a batch of fixed samples, a pass that can be
held or fail)."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import ray
import torch

from nemo_like.data.prompts import PromptDataLoader, PromptRecord
from nemo_like.distributed.worker_group import RayWorkerGroup, WorkerFailure
from nemo_like.experience.agent_rollouts import EngineGate
from nemo_like.experience.async_rollouts import async_actor_resources, replay_buffer_group
from nemo_like.experience.rollouts import Rollout
from nemo_like.experience.trajectory_collector import CollectorSettings, DriverTrajectoryCollector, TrajectoryCollector
from nemo_like.models.generation.interface import GeneratedSample, SamplingParams


class Agents:
    """Stands in for generation (``collect_rollout``'s agent branch): two fixed response tokens per sample."""

    weight_version = 0

    def serves(self, prompts, tasks) -> bool:
        return True

    def collect(self, envs, prompts, num_generations, seed, timings, greedy: bool = False) -> Rollout:
        expanded = [p for p in prompts for _ in range(num_generations)]
        samples = [GeneratedSample(list(p.prompt_token_ids), [5, 6], [-0.1, -0.2], False, 0, 0) for p in expanded]
        if timings is not None:
            timings["generation"], timings["reward"] = 0.0, 0.0
        groups = torch.arange(len(prompts)).repeat_interleave(num_generations)
        return Rollout(expanded, groups, samples, ["x"] * len(expanded), torch.ones(len(expanded)), {})

    def cancel(self) -> None:
        pass


class Reference:
    """A reference pass whose second batch is held until ``release`` (and then fails when ``fail`` is set)."""

    def __init__(self, fail: bool = False) -> None:
        self.release, self.fail, self.calls = threading.Event(), fail, 0

    def start(self, batch, **kwargs):
        return batch

    def gather(self, batch, what):
        self.calls += 1
        if self.calls == 2:
            assert self.release.wait(30)
            if self.fail:
                raise RuntimeError("reference worker died")
        return torch.zeros(batch["input_ids"].shape)

    def forward_pass_counts(self) -> dict[str, int]:
        return {"logprobs": 0}


BUFFERS: list[RayWorkerGroup] = []  # this test's replay buffer groups


@pytest.fixture(autouse=True)
def _buffers_kept_for_the_next_test():
    yield
    while BUFFERS:
        group = BUFFERS.pop()
        group.workers[0].finish.remote("the test ended")  # a take the test left waiting returns
        group.shutdown()  # kept (the session's reuse_actors) and re-initialised for the next one, as a run's is


def replay_buffer(max_age: int) -> object:
    """A real replay buffer actor (2 groups a step) of the async runs' shape, through the worker group they use: one
    actor kept between tests instead of a process started for each."""
    (role,) = [r for r in async_actor_resources(None) if r.role == "replay_buffer"]
    group = replay_buffer_group(role, groups_per_step=2, max_age=max_age, placement_timeout_s=60.0)
    BUFFERS.append(group)
    return group.workers[0]


def driver_collector(agents, reference, prompts: int, max_age: int, max_num_epochs: int) -> tuple[DriverTrajectoryCollector, object]:
    """A driver-thread collector over ``prompts`` prompts (2 a batch, 2 samples each) with ``agents`` for generation,
    ``reference`` for the reference pass, and a real replay buffer actor of the same age bound."""
    buffer = replay_buffer(max_age)
    loader = PromptDataLoader([PromptRecord(str(i), [], [1, 2, 3 + i], {"task_name": "t"}) for i in range(prompts)], 2, seed=0)
    settings = CollectorSettings(
        sampling=asdict(SamplingParams(max_new_tokens=4)), num_generations=2, seed=0, max_age=max_age, last_step=10,
        next_target=1, max_num_epochs=max_num_epochs, generation_version=0, reference=reference, pad_token_id=0,
    )  # fmt: skip
    return DriverTrajectoryCollector(None, SimpleNamespace(agents=agents, tasks=["t"]), buffer, None, loader, settings), buffer


def collector_at_data_end(reference: Reference) -> tuple[DriverTrajectoryCollector, object, threading.Thread]:
    """4 prompts, 2 a batch, one epoch: two batches. Returns once step 1 is taken and the loop waits at the data's end
    for batch 2's push (its reference pass held)."""
    collector, buffer = driver_collector(Agents(), reference, prompts=4, max_age=1, max_num_epochs=1)
    loader = collector.loader

    def run() -> None:
        with contextlib.suppress(RuntimeError):  # a failed push ends the loop with it: the test reads collector.failure
            collector.run()

    loop = threading.Thread(target=run, daemon=True)
    loop.start()
    ray.get(buffer.take.remote(1, 0))
    deadline = time.monotonic() + 30
    while not (loader.next_batch_epoch >= 1 and collector.pushing == 1 and not collector.in_flight):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return collector, buffer, loop


def test_a_pause_or_stop_at_the_data_end_is_served(ray_cluster) -> None:
    """The loop waited for the last push, then slept without looking at the pause (whose one notify it had used): the
    trainer's refit or checkpoint pause never returned and the run hung; a stop was lost the same way."""
    reference = Reference()
    collector, buffer, loop = collector_at_data_end(reference)
    paused = threading.Thread(target=collector.pause, args=("refit", False), daemon=True)
    paused.start()
    paused.join(10)
    assert not paused.is_alive()  # granted: nothing is generating
    time.sleep(0.05)
    # The data is spent (batch 2 was the last): generation was not held, though the pause lasted (it reported the
    # pause's length as idle/generation_paused_for_refit).
    assert collector.resume("refit", None) == 0.0 and collector.stats.paused_for_refit == 0.0
    reference.release.set()  # batch 2's push lands; the data is now at its end
    groups, _ = ray.get(buffer.take.remote(2, 0), timeout=30)
    assert len(groups) == 2
    collector.stop()
    loop.join(10)
    assert not loop.is_alive()


def test_a_failed_last_push_is_a_failure_not_the_data_end(ray_cluster) -> None:
    """The loop marked the data exhausted after a failed push: the trainer's take raised DataExhausted, a normal end,
    and the lost batch and its error went unreported."""
    reference = Reference(fail=True)
    collector, buffer, loop = collector_at_data_end(reference)
    reference.release.set()
    loop.join(30)
    assert not loop.is_alive() and "reference worker died" in str(collector.failure)
    # the buffer was never told the data ended: the take still waits for step 2 (DataExhausted would be a normal end)
    with pytest.raises(ray.exceptions.GetTimeoutError):
        ray.get(buffer.take.remote(2, 0), timeout=3)


def test_a_refit_pause_of_a_collector_held_by_the_bound_is_pacing_not_held_generation(ray_cluster) -> None:
    """Bound 0, batch 1 generated: the loop waits for exactly the weights the refit brings. The waiting-refit path
    charged the whole refit to idle/generation_paused_for_refit (the in-flight and agent paths report 0 there)."""
    collector, buffer = driver_collector(Agents(), Reference(), prompts=4, max_age=0, max_num_epochs=100)
    loop = threading.Thread(target=collector.run, daemon=True)
    loop.start()
    try:
        ray.get(buffer.take.remote(1, 0))  # batch 1 is in; batch 2 needs version 1
        deadline = time.monotonic() + 30
        while collector.in_flight or collector.pushing or collector.stats.waiting_for_pacing == 0.0:
            assert time.monotonic() < deadline
            with collector.cond:  # the loop counts a pacing wait when woken: batch 1's push may have notified before it waited
                collector.cond.notify_all()
            time.sleep(0.02)
        collector.pause("refit", until_pushed=False)
        pacing_before = collector.stats.waiting_for_pacing
        time.sleep(0.3)
        assert collector.resume("refit", 1) == 0.0 and collector.stats.paused_for_refit == 0.0
        assert collector.stats.waiting_for_pacing > pacing_before  # the pause went on counting as pacing (no time bound)
    finally:
        collector.stop()
        loop.join(30)


class LoadingGeneration:
    """Stands in for the engines' in-flight load counter (``mid_generation_seconds``): a running total that grows
    0.4 s in the first batch and 0.3 s in the second, then restarts from 0.1 (a replaced worker counts from 0)."""

    def __init__(self) -> None:
        self.totals = iter([0.4, 0.7, 0.1])

    def mid_generation_seconds(self) -> float:
        return next(self.totals)


class OneSecondAgents(Agents):
    def collect(self, envs, prompts, num_generations, seed, timings, greedy: bool = False) -> Rollout:
        rollout = super().collect(envs, prompts, num_generations, seed, timings)
        timings["generation"] = 1.0  # the generate calls' wall time, in-flight loads included
        return rollout


def generation_seconds_of_batches(batches: int, generation: object, agents: Agents, in_flight_refits: bool) -> float:
    """Run a driver collector over ``batches`` batches of 2 prompts (one epoch, each taken by its step) and return the
    generation seconds it counted."""
    buffer = replay_buffer(max_age=5)
    records = [PromptRecord(str(i), [], [1, 2, 3 + i], {"task_name": "t"}) for i in range(2 * batches)]
    settings = CollectorSettings(
        sampling=asdict(SamplingParams(max_new_tokens=4)), num_generations=2, seed=0, max_age=5, last_step=10, next_target=1,
        max_num_epochs=1, generation_version=0, reference=None, pad_token_id=0, in_flight_refits=in_flight_refits,
    )  # fmt: skip
    envs = SimpleNamespace(agents=agents, tasks=["t"])
    collector = DriverTrajectoryCollector(generation, envs, buffer, None, PromptDataLoader(records, 2, seed=0), settings)
    loop = threading.Thread(target=collector.run, daemon=True)
    loop.start()
    try:
        for step in range(1, batches + 1):
            ray.get(buffer.take.remote(step, 0), timeout=30)
        deadline = time.monotonic() + 30
        while collector.pushing or collector.in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        return collector.stats.generation_seconds
    finally:
        collector.stop()
        loop.join(30)


def test_in_flight_load_time_is_taken_out_of_the_generation_seconds(ray_cluster) -> None:
    """An in-flight refit loads on the generating thread inside a generate call: its seconds were counted as generation
    (and as idle/generation_paused_for_refit), so async/generation_tokens_per_sec read low."""
    seconds = generation_seconds_of_batches(3, LoadingGeneration(), OneSecondAgents(), in_flight_refits=True)
    assert seconds == pytest.approx((1 - 0.4) + (1 - 0.3) + 1.0)  # the restart: nothing taken


class GateHeldAgents(Agents):
    """An agent batch whose engine calls wait 0.25 s at the engine gate a waiting refit holds (the gate's total grows
    by what its release reports as idle/generation_paused_for_refit), inside a batch that took 1 s."""

    def __init__(self) -> None:
        super().__init__()
        self.engine = EngineGate(SimpleNamespace(weight_version=0))

    def collect(self, envs, prompts, num_generations, seed, timings, greedy: bool = False) -> Rollout:
        rollout = super().collect(envs, prompts, num_generations, seed, timings)
        self.engine.held_seconds += 0.25
        timings["generation"] = 1.0
        return rollout


def test_engine_calls_held_by_a_waiting_refit_are_taken_out_of_the_generation_seconds(ray_cluster) -> None:
    """Agent runs: a waiting refit holds the server's engine between two calls; the calls' wait was counted both as
    idle/generation_paused_for_refit and inside the batch's generation seconds (the subtraction ran for in-flight
    refits only), so the generation throughput read low."""
    assert generation_seconds_of_batches(2, None, GateHeldAgents(), in_flight_refits=False) == pytest.approx(2 * (1.0 - 0.25))


def test_a_refit_that_no_batch_would_use_is_skipped() -> None:
    """Once the last step's batch has started, a waiting refit (it waits for that batch to end) feeds nothing: the
    trainer waited for the last batch, then exported and loaded weights for nothing. An in-flight refit, and the agent
    path's refit (between two engine calls of the running sessions), still reach the running batch."""
    loader = PromptDataLoader([PromptRecord(str(i), [], [1, 2, 3 + i], {"task_name": "t"}) for i in range(4)], 2, seed=0)
    envs = SimpleNamespace(agents=Agents(), tasks=["t"])

    def collector(kind: type, next_target: int, in_flight_refits: bool, generating: bool) -> TrajectoryCollector:
        settings = CollectorSettings(
            sampling=asdict(SamplingParams(max_new_tokens=4)), num_generations=2, seed=0, max_age=1, last_step=2,
            next_target=next_target, max_num_epochs=100, generation_version=0, reference=None, pad_token_id=0,
            in_flight_refits=in_flight_refits,
        )  # fmt: skip
        made = kind.__new__(kind)
        TrajectoryCollector._setup(made, None, envs, None, None, loader, settings)
        made.in_flight = generating
        return made

    last_started = 3  # the pacer has handed out step 2, the last
    assert not collector(TrajectoryCollector, last_started, in_flight_refits=False, generating=True).needs_weights()
    assert collector(TrajectoryCollector, last_started, in_flight_refits=True, generating=True).needs_weights()
    assert collector(DriverTrajectoryCollector, last_started, in_flight_refits=False, generating=True).needs_weights()
    for kind in (TrajectoryCollector, DriverTrajectoryCollector):
        assert not collector(kind, last_started, in_flight_refits=True, generating=False).needs_weights()
        assert collector(kind, 2, in_flight_refits=False, generating=False).needs_weights()  # step 2's batch is to come


class BusyAgents(Agents):
    """Agents whose third batch runs until ``release`` (a long agent batch on the loop thread)."""

    def __init__(self) -> None:
        self.batches, self.release, self.busy = 0, threading.Event(), threading.Event()

    def collect(self, envs, prompts, num_generations, seed, timings, greedy: bool = False) -> Rollout:
        self.batches += 1
        if self.batches == 3:
            self.busy.set()
            assert self.release.wait(60)
        return super().collect(envs, prompts, num_generations, seed, timings)

    def close(self) -> int:
        return 0  # the agent threads left running at shutdown: none


class DyingReference(Reference):
    """Batch 2's reference pass finds its worker dead (as ``get_with_context`` reports a dead actor)."""

    def gather(self, batch, what):
        self.calls += 1
        if self.calls == 2:
            raise WorkerFailure(f"Ray actor ref123 died during '{what}'", role=what.split(":")[0], actor_id="ref123")
        return torch.zeros(batch["input_ids"].shape)


def test_a_dead_reference_worker_seen_by_a_pause_while_an_agent_batch_runs_keeps_its_role(ray_cluster) -> None:
    """Agent runs (the collector on a driver thread): the pusher's reference pass found its worker dead while the loop
    was busy with the next agent batch; the checkpoint's pause raised the collector's failure, but the driver waited 5 s
    for the busy loop and raised a new error without the dead actor's role, so the run stopped instead of restarting
    from its checkpoint (the actor path kept the role)."""
    from nemo_like.algorithms.restarts import dead_role
    from nemo_like.experience.async_rollouts import AsyncRollouts, DriverCollectorThread

    agents = BusyAgents()
    collector, _ = driver_collector(agents, DyingReference(), prompts=8, max_age=5, max_num_epochs=1)
    rollouts = AsyncRollouts.__new__(AsyncRollouts)  # only its control call on a driver-thread collector is exercised
    rollouts.local = DriverCollectorThread(collector)
    try:
        assert agents.busy.wait(30)
        deadline = time.monotonic() + 30
        while collector.failure is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(WorkerFailure) as failed:
            rollouts._call("pause", "checkpoint")
    finally:
        agents.release.set()
        rollouts.local.stop(30)
    assert failed.value.actor_id == "ref123"
    assert dead_role(failed.value, {"policy": {"pol1"}, "reference": {"ref123"}}) == "reference"


class CancelledAgents(BusyAgents):
    """Busy agents whose third batch the stop cancels (it then raises, as cancelled agent sessions do)."""

    def collect(self, envs, prompts, num_generations, seed, timings, greedy: bool = False) -> Rollout:
        rollout = super().collect(envs, prompts, num_generations, seed, timings)
        if self.batches == 3:
            raise RuntimeError("the agent batch was cancelled")
        return rollout

    def cancel(self) -> None:
        self.release.set()


def test_an_agent_run_stopped_while_a_push_waits_does_not_keep_its_replay_buffer(ray_cluster) -> None:
    """The agent path's stop cancels the batch in flight without waiting for the pusher: a push still waiting for its
    reference pass landed in the kept buffer after the next run had re-initialised it (a reviewer's two runs: the next
    run's own push was refused as out of order). Such a run's buffer is killed, not kept."""
    from nemo_like.distributed.worker_group import _POOL
    from nemo_like.experience.async_rollouts import AsyncRollouts, DriverCollectorThread

    agents, reference = CancelledAgents(), Reference()  # batch 2's reference pass is held
    collector, buffer = driver_collector(agents, reference, prompts=8, max_age=5, max_num_epochs=1)
    rollouts = AsyncRollouts.__new__(AsyncRollouts)  # only its shutdown of a driver-thread collector is exercised
    rollouts.local, rollouts.buffer, rollouts.buffer_group = DriverCollectorThread(collector), buffer, BUFFERS.pop()
    try:
        assert agents.busy.wait(30)  # batch 3 runs
        deadline = time.monotonic() + 30
        while not (reference.calls == 2 and collector.pushing == 1):  # batch 1 is in; batch 2's push waits for its reference
            assert time.monotonic() < deadline
            time.sleep(0.02)
        rollouts.shutdown()
        assert not rollouts.local.thread.is_alive() and rollouts.local.error is None  # the stop itself went cleanly
        assert not any(buffer in group.workers for group in _POOL.idle)  # killed: the push may still land
    finally:
        reference.release.set()


def test_a_dead_generation_worker_counts_no_load_seconds_instead_of_failing_the_read(ray_cluster) -> None:
    """With in-flight refits the collector reads every engine's load counter after each batch; an engine that died
    after its generate call returned (while the batch was scored) failed that read, and with it the collector and the
    run, though the next generate call would have replaced it."""
    from nemo_like.experience.trajectory_collector import ActorHandles

    class Counting:  # defined here: Ray's workers get it by value (they cannot import this test module)
        def __init__(self, seconds: float) -> None:
            self.seconds = seconds

        def mid_generation_seconds(self) -> float:
            return self.seconds

    live, dead = (ray.remote(Counting).remote(s) for s in (0.5, 2.0))
    handles = ActorHandles([live, dead])
    assert handles.mid_generation_seconds() == pytest.approx(2.5)
    ray.kill(dead)
    deadline = time.monotonic() + 30
    while True:  # ray.kill returns before the actor is gone: a read right after it could still reach it
        try:
            ray.get(dead.mid_generation_seconds.remote())
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert handles.mid_generation_seconds() == pytest.approx(0.5)


def test_a_validation_holds_generation_and_its_wait_for_the_batch_in_flight_is_timed(monkeypatch) -> None:
    """A validation holds the collector between batches and runs on the idle engine (queued behind a batch, a validation
    call counted that wait against call_timeout_s: a healthy engine was killed as hung). The last step skipped its
    refit while the last batch generated (no batch would use it); the validation waits for that batch, then refits:
    the wait is in the validation phase (it was in no timer phase once: the step's phases no longer added up)."""
    import nemo_like.algorithms.grpo as grpo
    from nemo_like.experience.async_rollouts import AsyncRollouts
    from nemo_like.utils.timer import StepTimer

    loader = PromptDataLoader([PromptRecord(str(i), [], [1, 2, 3 + i], {"task_name": "t"}) for i in range(8)], 2, seed=0)
    settings = CollectorSettings(
        sampling=asdict(SamplingParams(max_new_tokens=4)), num_generations=2, seed=0, max_age=1, last_step=3,
        next_target=4, max_num_epochs=100, generation_version=1, reference=None, pad_token_id=0,
    )  # fmt: skip
    collector = TrajectoryCollector.__new__(TrajectoryCollector)  # the actor's loop state, on this thread
    TrajectoryCollector._setup(collector, None, SimpleNamespace(agents=None, tasks=["t"]), None, None, loader, settings)
    collector.in_flight = True  # step 3's batch (the last) generates with weights v1

    def last_batch_ends() -> None:  # what the loop does as its batch ends: then it waits for its next target (paused)
        while not collector.pause_reasons:  # the validation (or a refit) waits for the batch from here on
            time.sleep(0.01)
        time.sleep(0.5)
        with collector.cond:
            collector.in_flight = False
            collector.cond.notify_all()
        collector._wait_for_next_target()

    class Generation:
        weight_version = 1

        def refit(self, buckets, version) -> float:
            self.weight_version = version
            return 0.01

    parts = SimpleNamespace(policy=SimpleNamespace(weight_version=2, weight_buckets=None), generation=Generation())
    rollouts = AsyncRollouts.__new__(AsyncRollouts)  # its refit and control calls on a collector in this process
    rollouts.parts, rollouts.in_flight, rollouts.agents = parts, False, None
    rollouts.local = SimpleNamespace(collector=collector)
    assert not rollouts.needs_refit()  # the step skipped its refit
    steps = grpo.AsyncSteps(parts)
    steps.rollouts = rollouts
    held_while_validating: list[bool] = []

    def validate(parts, step) -> dict[str, float]:
        held_while_validating.append(not collector.in_flight and "validation" in collector.pause_reasons)
        time.sleep(0.2)
        return {"validation/accuracy": 0.5}

    monkeypatch.setattr(grpo, "validate", validate)
    threading.Thread(target=last_batch_ends, daemon=True).start()
    timer = StepTimer()
    metrics = steps.validate(3, timer)
    assert held_while_validating == [True] and not collector.pause_reasons  # held, then released
    assert timer.seconds["validation"] >= 0.4 + 0.2 and timer.seconds["refit"] == pytest.approx(0.01)
    assert timer.seconds["waiting_for_refit"] < 0.1 and metrics["idle/trainer_waiting_for_refit"] == timer.seconds["waiting_for_refit"]
    assert metrics["validation/accuracy"] == 0.5 and parts.generation.weight_version == 2
