"""Actor reuse between runs of one driver process (``reuse_actors``), on real Ray actors."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import ray
from ray import cloudpickle

from nemo_like.config.sections.run import FaultToleranceConfig
from nemo_like.distributed import supervision
from nemo_like.distributed.worker_group import RayWorkerGroup, Reinitializable, WorkerFailure, WorkerResources, reuse_actors

pytestmark = pytest.mark.slow
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import the tests package


class Counter(Reinitializable):
    """A small actor with state that a re-initialisation must reset."""

    def __init__(self, rank: int, world_size: int, start: int) -> None:
        self.rank, self.value = rank, start

    def bump(self) -> tuple[int, int, int]:
        self.value += 1
        return os.getpid(), self.rank, self.value


class NotReusable:
    def __init__(self, rank: int, world_size: int) -> None:
        pass

    def pid(self) -> int:
        return os.getpid()


def bump_all(group: RayWorkerGroup) -> list[tuple[int, int, int]]:
    return ray.get(group.run_all("bump"))


def wait_until_dead(actor, timeout_s: float = 60) -> None:
    """Until a call on ``actor`` fails with RayActorError (a kill has landed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.bump.remote())
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, "the killed actor still answers"
        time.sleep(0.1)


def test_a_kept_group_is_reinitialised_in_place_and_other_shapes_get_new_actors(ray_cluster):
    resources = WorkerResources(num_cpus=0.01)
    with reuse_actors():
        first = RayWorkerGroup("counter", Counter, 2, resources, {"start": 10})
        before = bump_all(first)
        assert [(rank, value) for _, rank, value in before] == [(0, 11), (1, 11)]
        first.shutdown()

        again = RayWorkerGroup("counter", Counter, 2, resources, {"start": 100})
        after = bump_all(again)
        assert [pid for pid, _, _ in after] == [pid for pid, _, _ in before]  # same processes...
        assert [(rank, value) for _, rank, value in after] == [(0, 101), (1, 101)]  # ...fresh state
        again.shutdown()

        one = RayWorkerGroup("counter", Counter, 1, resources, {"start": 0})  # another shape: new actor
        assert bump_all(one)[0][0] not in {pid for pid, _, _ in before}
        ray.kill(one.workers[0], no_restart=True)
        wait_until_dead(one.workers[0])  # ray.kill returns before the actor is gone
        one.shutdown()  # a dead actor is kept...
        fresh = RayWorkerGroup("counter", Counter, 1, resources, {"start": 0})  # ...but never reused
        assert bump_all(fresh)[0][2] == 1
        fresh.shutdown()

        plain = RayWorkerGroup("plain", NotReusable, 1, resources, {})
        plain_pid = ray.get(plain.workers[0].pid.remote())
        plain.shutdown()  # not Reinitializable: killed, not kept
        replacement = RayWorkerGroup("plain", NotReusable, 1, resources, {})
        assert ray.get(replacement.workers[0].pid.remote()) != plain_pid
        replacement.shutdown()


class ThreadedCounter(Reinitializable):
    """Applies its thread count at every (re-)initialisation, as the policy and HF generation workers do."""

    SETS_THREADS_ON_INIT = True

    def __init__(self, rank: int, world_size: int, num_threads: int) -> None:
        from nemo_like.distributed.threads import apply_thread_count

        apply_thread_count(num_threads)

    def threads(self) -> tuple[int, int, str]:
        import torch

        return os.getpid(), torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]

    def visible_gpus(self) -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_kept_actor_takes_a_new_thread_count_only_when_its_class_applies_it(ray_cluster):
    with reuse_actors():
        two = RayWorkerGroup("threaded", ThreadedCounter, 1, WorkerResources(num_cpus=0.01, num_threads=2), {"num_threads": 2})
        pid, threads, env = ray.get(two.workers[0].threads.remote())
        assert (threads, env) == (2, "2")
        # An actor given no GPU sees none (Ray 2.48+ no longer hides them: on a GPU node it saw all and took cuda:0)
        assert ray.get(two.workers[0].visible_gpus.remote()) == ""
        two.shutdown()
        one = RayWorkerGroup("threaded", ThreadedCounter, 1, WorkerResources(num_cpus=0.01, num_threads=1), {"num_threads": 1})
        assert ray.get(one.workers[0].threads.remote()) == (pid, 1, "1")  # the same process, now on 1 thread
        one.shutdown()

        # A class that does not apply its threads keeps them in the key: another count gets another actor.
        fixed = RayWorkerGroup("fixed", Counter, 1, WorkerResources(num_cpus=0.01, num_threads=2), {"start": 0})
        fixed_pid = bump_all(fixed)[0][0]
        fixed.shutdown()
        other = RayWorkerGroup("fixed", Counter, 1, WorkerResources(num_cpus=0.01, num_threads=1), {"start": 0})
        assert bump_all(other)[0][0] != fixed_pid
        other.shutdown()


def test_a_kept_actor_serves_only_a_run_that_forwards_it_the_same_environment(ray_cluster, monkeypatch):
    """The reuse key held only the group's own env_vars: a kept actor kept the last run's HF_HOME, offline flags and
    PYTHONPATH (what the driver forwards) when the next run's differed."""
    with reuse_actors():
        monkeypatch.setenv("HF_HOME", "/tmp/nemo_like_hf_home_a")
        first = RayWorkerGroup("forwarded", Counter, 1, WorkerResources(num_cpus=0.01), {"start": 0})
        pid = bump_all(first)[0][0]
        first.shutdown()
        again = RayWorkerGroup("forwarded", Counter, 1, WorkerResources(num_cpus=0.01), {"start": 0})
        assert bump_all(again)[0][0] == pid  # the same environment: kept
        again.shutdown()
        monkeypatch.setenv("HF_HOME", "/tmp/nemo_like_hf_home_b")
        other = RayWorkerGroup("forwarded", Counter, 1, WorkerResources(num_cpus=0.01), {"start": 0})
        assert bump_all(other)[0][0] != pid
        assert ray.get(other.workers[0].__ray_call__.remote(lambda _: os.environ["HF_HOME"])) == "/tmp/nemo_like_hf_home_b"
        other.shutdown()


def test_a_kept_group_that_refuses_a_runs_settings_is_killed_and_frees_its_bundles(ray_cluster):
    """A run whose settings a kept group's re-initialisation refuses (a bad key in one run of a sweep): the group was
    out of the pool and only a dead actor was cleaned up, so its actors and placement group leaked; every later run of
    the process then failed to place. The refusal reads as a fresh actor's does (it was Ray's remote traceback, not a
    WorkerFailure)."""
    resources = WorkerResources(num_cpus=0.01)
    fresh = RayWorkerGroup("picky", PickyCounter, 1, resources, {"start": -1})
    with pytest.raises(WorkerFailure, match=r"during 'picky: start'.*: its constructor raised ValueError: start must be >= 0, got -1$"):
        fresh.wait_started()
    fresh.kill()
    with reuse_actors():
        kept = RayWorkerGroup("picky", PickyCounter, 2, resources, {"start": 1})
        workers, pg = kept.workers, kept._pg
        kept.shutdown()
        refused = r"^a kept picky actor failed during 'picky: start' .*: its constructor raised ValueError: start must be >= 0, got -1$"
        with pytest.raises(WorkerFailure, match=refused):
            RayWorkerGroup("picky", PickyCounter, 2, resources, {"start": -1})
        for worker in workers:
            wait_until_dead(worker)
        deadline = time.monotonic() + 30
        while ray.util.placement_group_table(pg)["state"] != "REMOVED":
            assert time.monotonic() < deadline, ray.util.placement_group_table(pg)
            time.sleep(0.1)
        again = RayWorkerGroup("picky", PickyCounter, 2, resources, {"start": 5})  # new actors, good settings
        assert [value for _, _, value in bump_all(again)] == [6, 6]
        again.shutdown()


def test_a_group_whose_actor_cannot_start_releases_its_bundles(ray_cluster):
    """An actor Ray cannot start (an argument it cannot serialise, a Ctrl-C): the group's placement group stayed
    reserved, ownerless, and later groups could not be placed."""

    def reserved() -> list[str]:
        return [
            g["name"] for g in ray.util.placement_group_table().values() if g["name"].startswith("unstartable-") and g["state"] != "REMOVED"
        ]

    with pytest.raises(TypeError, match="Could not serialize"):
        RayWorkerGroup("unstartable", Counter, 2, WorkerResources(num_cpus=0.5), {"start": threading.Lock()})
    assert reserved() == []


class PickyCounter(Counter):
    def __init__(self, rank: int, world_size: int, start: int) -> None:
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        super().__init__(rank, world_size, start)


class Hangs(Reinitializable):
    def __init__(self, rank: int, world_size: int) -> None:
        pass

    def hang(self) -> None:
        time.sleep(3600)  # what a run the stall watchdog aborted leaves behind

    def pid(self) -> int:
        return os.getpid()


def test_a_kept_actor_stuck_in_a_hung_call_is_replaced_not_waited_for(ray_cluster, capsys):
    """The next run's re-initialisation queued behind the hung call, and its setup waited forever."""
    with reuse_actors():
        first = RayWorkerGroup("stuck", Hangs, 1, WorkerResources(num_cpus=0.01), {}, placement_timeout_s=2)
        stuck_pid = ray.get(first.workers[0].pid.remote())
        first.workers[0].hang.remote()
        first.shutdown()  # kept idle, still in the hung call
        made: list[RayWorkerGroup] = []  # built on a thread: a regression blocks it forever instead of the test run
        builder = threading.Thread(
            target=lambda: made.append(RayWorkerGroup("stuck", Hangs, 1, WorkerResources(num_cpus=0.01), {}, placement_timeout_s=2)),
            daemon=True,
        )
        builder.start()
        builder.join(120)
        assert made, "the next run's set-up is still blocked on the kept, hung actor"
        second = made[0]
        assert ray.get(second.workers[0].pid.remote(), timeout=60) != stuck_pid
        assert "stuck: a kept actor did not re-initialise within 2s; starting fresh ones" in capsys.readouterr().out
        second.kill()


class SlowStart:
    def __init__(self, rank: int, world_size: int, delay_s: float) -> None:
        time.sleep(delay_s)  # a verifier or reward model loading

    def score(self, x: int) -> int:
        return x


def test_a_replacement_that_starts_slower_than_call_timeout_is_not_killed_as_hung(ray_cluster):
    """The re-sent call's deadline counted the fresh actor's constructor: each replacement was "hung" in turn and the run
    stopped with its restarts exhausted, though every actor was healthy."""
    group = RayWorkerGroup("environment:slow", SlowStart, 1, WorkerResources(num_cpus=0.01), {"delay_s": 4.0})
    group.wait_started()
    run = supervision.begin_run(FaultToleranceConfig(call_timeout_s=2.0, max_actor_restarts=2, max_retries_per_batch=2))
    calls = [supervision.Call(supervision.Replaceable("environment", group), 0, lambda w: w.score.remote(42))]
    dead = group.workers[0]
    ray.kill(dead, no_restart=True)  # asynchronous: a call sent at once may still be answered
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(dead.score.remote(0))
        except ray.exceptions.RayActorError:
            break
    try:
        assert supervision.gather(calls, supervision.dispatch(calls), "reward") == [42]
        assert run.restarts == {"environment": 1}  # the death; no "hung" replacement after it
    finally:
        group.kill()
        supervision.begin_run(None)


def test_a_later_run_of_the_process_naming_another_cluster_is_refused(ray_cluster):
    """A second run of a sweep with cluster.ray_address set silently ran on the first run's private cluster."""
    from nemo_like.config import ConfigError
    from nemo_like.config.schema import ClusterConfig
    from nemo_like.distributed.ray_init import init_ray

    assert init_ray(ClusterConfig()) == "local"  # the session's private cluster, started by init_ray
    with pytest.raises(
        ConfigError,
        match=r"cluster.ray_address names the Ray cluster at '10.9.9.9:6379', but this process is already connected to its private local cluster",
    ):
        init_ray(ClusterConfig(ray_address="10.9.9.9:6379"))


ACROSS_SESSIONS = r"""
import os
import ray
from nemo_like.distributed.worker_group import _POOL, RayWorkerGroup, Reinitializable, WorkerResources, reuse_actors

class Pid(Reinitializable):
    def __init__(self, rank, world_size):
        self.pid = __import__("os").getpid()
    def ping(self):
        return self.pid

def connect():  # the session cluster: each connection is a new Ray job, whose actors die when it disconnects
    ray.init(address=os.environ["SESSION_GCS"], log_to_driver=False)

with reuse_actors():
    connect()
    first = RayWorkerGroup("policy", Pid, 1, WorkerResources(0.01), {}, 30)
    old = ray.get(first.workers[0].ping.remote())
    first.shutdown()  # kept idle for the next run
    ray.shutdown()  # what init_ray's error tells a sweep to do before a run on another cluster
    connect()
    second = RayWorkerGroup("policy", Pid, 1, WorkerResources(0.01), {}, 30)
    new = ray.get(second.workers[0].ping.remote(), timeout=60)
    second.shutdown()
    ray.shutdown()
print("OK", old != new, len(_POOL.idle), ray.is_initialized())
"""


def test_groups_kept_before_a_ray_shutdown_are_forgotten_not_reused(ray_cluster, tmp_path):
    """A sweep inside reuse_actors() that reconnects (ray.shutdown(), as init_ray's error advises): the next run took
    the kept group's stale handles ('Can't find actor ... from a different cluster'), and leaving the block killed
    them through a new default Ray instance it started. A driver of its own (it disconnects), joined to the session
    cluster twice: a new connection is a new Ray job, as a new cluster is (two private clusters cost ~20 s)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    gcs = ray_cluster.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": str(root), "RAY_ADDRESS": "", "SESSION_GCS": gcs}
    done = subprocess.run([sys.executable, "-c", ACROSS_SESSIONS], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "OK True 0 False", done.stdout


class ThreadedWork(Reinitializable):
    """A threaded actor (max_concurrency 2) whose ``work`` a run may leave running when it ends."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.running = 0
        self.inits = getattr(self, "inits", 0) + 1

    def work(self, seconds: float) -> int:
        self.running += 1
        try:
            time.sleep(seconds)
            return self.inits  # the run it started in: a re-initialisation under it would have counted one more
        finally:
            self.running -= 1

    def busy_with(self) -> str | None:
        return "a work call" if self.running else None

    def pid(self) -> int:
        return os.getpid()


def test_a_kept_threaded_actor_is_reinitialised_after_its_last_runs_call_not_under_it(ray_cluster, capsys):
    """A threaded actor answered the re-initialisation at once, on its other thread, while the last run's call still
    ran: the next run's state was rebuilt under it."""
    resources = WorkerResources(num_cpus=0.01)
    with reuse_actors():
        first = RayWorkerGroup("threaded", ThreadedWork, 1, resources, {}, placement_timeout_s=60, max_concurrency=2)
        pid = ray.get(first.workers[0].pid.remote())
        left_running = first.workers[0].work.remote(1.5)
        ray.get(first.workers[0].pid.remote())  # work has started
        first.shutdown()  # kept idle, its call still running
        second = RayWorkerGroup("threaded", ThreadedWork, 1, resources, {}, placement_timeout_s=60, max_concurrency=2)
        assert ray.get(second.workers[0].pid.remote()) == pid, "an idle-in-time kept actor is reused"
        ready, _ = ray.wait([left_running], timeout=0)
        assert ready and ray.get(left_running) == 1, "re-initialised while the last run's call still ran"
        # A call that does not end within the placement timeout: fresh actors, as for a hung single-threaded one.
        second.workers[0].work.remote(3600)
        ray.get(second.workers[0].pid.remote())
        second.shutdown()
        third = RayWorkerGroup("threaded", ThreadedWork, 1, resources, {}, placement_timeout_s=1, max_concurrency=2)
        assert ray.get(third.workers[0].pid.remote(), timeout=60) != pid
        assert "threaded: a kept actor is still in a work call of the last run after 1s; starting fresh ones" in capsys.readouterr().out
        third.kill()
