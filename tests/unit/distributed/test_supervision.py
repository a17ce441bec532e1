"""The supervisor's bookkeeping: budgets per role and per batch, the error that lists every death, the counters the
loop logs, and a batch with two dead actors (real actors on the session cluster). Replacing the run's own actors is
tested end to end in tests/functional/test_fault_tolerance.py."""

from __future__ import annotations

import pytest

from nemo_like.config.sections.run import FaultToleranceConfig
from nemo_like.distributed.supervision import ActorRestartsExhausted, Death, FaultLedger, Replaceable, begin_run, ledger
from nemo_like.distributed.worker_group import WorkerFailure


def death(role: str = "generation", attempt: int = 0, cause: str = "The actor died unexpectedly", step: int = 2) -> Death:
    return Death(role, f"{role} rank 0 (actor ab12)", "generation" if role == "generation" else "reward", cause, step, attempt)


def test_the_ledger_takes_its_budgets_from_the_config_and_a_run_starts_a_fresh_one():
    ft = FaultToleranceConfig(max_actor_restarts=5, max_retries_per_batch=1, call_timeout_s=30)
    run = begin_run(ft)
    assert ledger() is run and (run.max_actor_restarts, run.max_retries_per_batch, run.call_timeout_s) == (5, 1, 30)
    run.record(death())
    assert begin_run(None).deaths == [] and ledger().max_actor_restarts == 3  # the defaults


def test_each_role_has_its_own_restart_budget_over_the_run():
    run = FaultLedger(max_actor_restarts=1)
    run.record(death("generation"))
    run.record(death("environment"))  # another role: its own budget
    assert run.restarts == {"generation": 1, "environment": 1}
    with pytest.raises(ActorRestartsExhausted) as stopped:
        run.record(death("generation", cause="OOM killed", step=7))
    message = str(stopped.value)
    assert message.startswith("an actor died past cluster.fault_tolerance.max_actor_restarts=1 for role 'generation'")
    # Every death of the run, in order, each with its step, actor, phase and cause.
    assert message.splitlines()[1:] == [
        "  1. step 2, generation rank 0 (actor ab12) during 'generation': The actor died unexpectedly",
        "  2. step 2, environment rank 0 (actor ab12) during 'reward': The actor died unexpectedly",
        "  3. step 7, generation rank 0 (actor ab12) during 'generation': OOM killed",
    ]
    assert run.restarts["generation"] == 1  # the refused replacement is not counted


def test_a_batch_is_re_sent_at_most_max_retries_per_batch_times():
    run = FaultLedger(max_actor_restarts=10, max_retries_per_batch=2)
    run.record(death(attempt=0))
    run.record(death(attempt=1))
    with pytest.raises(ActorRestartsExhausted, match=r"max_retries_per_batch=2") as stopped:
        run.record(death(attempt=2))
    assert ", re-send 2: " in str(stopped.value)
    zero = FaultLedger(max_actor_restarts=0)
    with pytest.raises(ActorRestartsExhausted, match="max_actor_restarts=0"):
        zero.record(death())  # 0: the first death stops the run


def test_the_exhausted_error_is_a_worker_failure_the_cli_prints():
    assert issubclass(ActorRestartsExhausted, WorkerFailure)


def test_counters_appear_once_an_actor_died():
    run = FaultLedger()
    assert run.metrics() == {}  # a run without deaths logs no faults/* keys (its metrics stay the same)
    run.record(death("environment"))
    run.retried_batches, run.seconds_lost = 1, 1.5
    assert run.metrics() == {"faults/actor_restarts/environment": 1.0, "faults/retried_batches": 1.0, "faults/seconds_lost": 1.5}


class StandInGroup:
    """An actor group's stand-in: ``replace`` puts a fresh worker in place of rank's (``w0`` -> ``w0'``), and
    ``wait_started`` records the ranks it waited for."""

    name = "generation"

    def __init__(self, *workers: str) -> None:
        self.workers, self.started = list(workers), []

    def replace(self, rank: int) -> str:
        self.workers[rank] = f"{self.workers[rank]}'"
        return self.workers[rank]

    def wait_started(self, ranks: list[int]) -> None:
        self.started.append(ranks)


def test_a_replacement_is_prepared_before_it_serves():
    group = StandInGroup("w0")
    prepared = []
    target = Replaceable("generation", group, lambda worker: prepared.append((list(group.started), worker)))
    assert target.replace(0) == "w0'" and prepared == [([[0]], "w0'")]  # built and started, then prepared
    assert target.describe(0) == "generation rank 0 (actor ?)"  # not an actor handle: no id


def test_a_replacement_is_progress_for_the_stall_watchdog_wherever_it_is_made():
    """Also where the driver serves an async collector's request (``AsyncRollouts._replace_for_collector`` calls
    ``replace_dead`` directly): only the supervised re-send marked progress, and a recovering async run could be
    reported, or aborted, as stalled."""
    from nemo_like.utils.run_control import RunControl, activate, run_control

    begin_run(None)
    activate(RunControl())
    try:
        run_control().last_progress = 0.0
        assert Replaceable("generation", StandInGroup("w0")).replace_dead(0, death()) == "w0'"
        assert run_control().last_progress > 0.0
    finally:
        activate(None)


def test_results_that_arrive_just_past_the_deadline_are_neither_re_sent_nor_counted(ray_cluster, capsys):
    """The batch's wait timed out, yet every result was there when each was read: nothing was replaced, so no
    "re-sent" line and no seconds lost (the whole wait was added to faults/seconds_lost). Real Ray objects, in the state
    :func:`gather` hands to its recovery when the batch's wait times out: the deadline passed, the results now there
    (real actors cannot be made to answer inside that window on demand)."""
    import time

    import ray

    from nemo_like.distributed.supervision import Call, _recover

    run = begin_run(FaultToleranceConfig(call_timeout_s=1))
    group = StandInGroup("w0", "w1")
    target = Replaceable("generation", group)
    calls = [Call(target, rank, lambda worker: None) for rank in (0, 1)]
    arrived = [ray.put(10), ray.put(20)]
    assert _recover(calls, arrived, "generation", started=time.monotonic() - 2) == [10, 20]  # the deadline 1 s ago
    assert (run.retried_batches, run.seconds_lost, run.deaths, group.workers) == (0, 0.0, [], ["w0", "w1"])  # none replaced
    assert "re-sent" not in capsys.readouterr().out


def test_a_system_level_death_is_reported_with_its_cause_not_rays_fixed_first_line():
    """Every death Ray reports for a killed worker process (its memory monitor, the kernel's OOM killer, a segfault, a
    lost node) starts with the same fixed line; the one line the user saw was that line, never 'out of memory'."""
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    from nemo_like.distributed.worker_group import death_reason

    oom = (
        "The actor is dead because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY Worker exit detail: "
        "Task was killed due to the node running low on memory."
    )
    error = ActorDiedError(ActorDiedErrorContext(error_message=oom, class_name="PolicyWorker", actor_id=b"\x01" * 16, pid=42))
    assert str(error).strip().splitlines()[0] == ActorDiedError.BASE_ERROR_MSG  # what Ray says first
    assert death_reason(error) == oom
    long = ActorDiedError(ActorDiedErrorContext(error_message="x" * 1000, class_name="PolicyWorker", actor_id=b"\x01" * 16, pid=42))
    assert len(death_reason(long)) == 400 and death_reason(long).endswith("...")
    # A constructor's pydantic error (vLLM's configs): the line saying what was invalid, without the input it echoes or
    # the closing link ("its constructor raised For further information visit https://errors.pydantic.dev/...")
    pydantic = RuntimeError(
        "The actor died because of an error raised in its creation task, ray::VLLMGenerationWorker.__init__()\n"
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        f"  Value error, Model architectures ['X'] are not supported for now. Supported: {'A' * 5000} [type=value_error, input_value=...]\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error"
    )
    reason = death_reason(pydantic)
    assert reason.startswith("its constructor raised Value error, Model architectures ['X'] are not supported") and len(reason) < 450
    short = RuntimeError(str(pydantic).replace("A" * 5000, "['LlamaForCausalLM']"))
    assert death_reason(short) == (
        "its constructor raised Value error, Model architectures ['X'] are not supported for now. Supported: ['LlamaForCausalLM']"
    )


def test_two_dead_actors_in_one_batch_are_two_deaths_one_retried_batch_and_only_their_calls_re_sent(ray_cluster, tmp_path, capsys):
    """faults/retried_batches counts batches, not calls or deaths; a call whose actor answered is not sent again. Real
    actors in a real group: ranks 1 and 2 die in their first call (their process exits), and their replacements answer."""
    import os

    import ray

    from nemo_like.distributed.supervision import Call, gather
    from nemo_like.distributed.worker_group import RayWorkerGroup, WorkerResources

    class Answering:  # defined here: Ray's workers get it by value (they cannot import this test module)
        def __init__(self, rank: int, world_size: int, doomed: list[int], marks: str) -> None:
            self.rank, self.doomed, self.marks = rank, doomed, marks

        def answer(self, tag: str) -> str:
            first_life = os.path.join(self.marks, f"rank{self.rank}")
            if self.rank in self.doomed and not os.path.exists(first_life):
                open(first_life, "w").close()
                os._exit(1)  # the process dies under its call
            return f"{tag}{self.rank} pid {os.getpid()}"

        def pid(self) -> int:
            return os.getpid()

    group = RayWorkerGroup("generation", Answering, 3, WorkerResources(num_cpus=0.01), {"doomed": [1, 2], "marks": str(tmp_path)})
    try:
        pids = ray.get([w.pid.remote() for w in group.workers])
        run = begin_run(FaultToleranceConfig(max_actor_restarts=5))
        target = Replaceable("generation", group)
        sent: list[int] = []

        def submit(rank: int):
            def call(worker):
                sent.append(rank)
                return worker.answer.remote("r")

            return call

        calls = [Call(target, rank, submit(rank)) for rank in range(3)]
        refs = [c.submit(group.workers[c.rank]) for c in calls]
        answers = gather(calls, refs, "generation")
        new_pids = ray.get([w.pid.remote() for w in group.workers])
    finally:
        group.kill()
    assert [a.split(" pid ")[0] for a in answers] == ["r0", "r1", "r2"]
    assert new_pids[0] == pids[0] and new_pids[1] not in pids and new_pids[2] not in pids  # ranks 1 and 2 replaced
    assert answers == [f"r{rank} pid {pid}" for rank, pid in enumerate(new_pids)]  # each answered by today's actor
    assert sent == [0, 1, 2, 1, 2]  # only the dead actors' calls, to their replacements
    assert run.retried_batches == 1 and run.restarts == {"generation": 2} and len(run.deaths) == 2
    assert run.seconds_lost > 0 and "'generation' re-sent to the replaced actor(s)" in capsys.readouterr().out
