"""A group of identical Ray actors placed by resources, with broadcast and sharded dispatch.

The training loop talks to a :class:`RayWorkerGroup` as if it were one object; the group turns a
call into one remote call per actor and gathers the results.

Inside :func:`reuse_actors`, a group that shuts down is kept alive (idle) instead of killed, and the
next group asking for the same actors (class, count, resources, environment) re-initialises them in
place: several runs in one driver process (a sweep, a notebook, the functional tests) pay for
process start-up and imports once. Only classes that define ``reinit`` (see :class:`Reinitializable`)
are kept.

A group started with ``node_id`` is pinned to that Ray node (``NodeAffinitySchedulingStrategy``, not soft)
instead of placed in a placement group of its own: a colocated generation engine must run on the node of
the policy rank whose GPU it shares. Its actors must be granted their resources on that node within the
placement timeout, as a placement group must (:func:`wait_until_placed`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from nemo_like.distributed.ray_env import worker_env_vars
from nemo_like.distributed.reinit import Reinitializable


class WorkerFailure(RuntimeError):
    """A Ray actor died or raised while the driver waited on it; the message names actor and phase. ``role``: the role
    the phase names (its text before ':', e.g. ``policy`` in ``'policy: training'``), ``actor_id``: the dead actor's id,
    when known (the driver's run restarts tell a policy or reference death from others by them)."""

    def __init__(self, message: str, role: str | None = None, actor_id: str | None = None) -> None:
        super().__init__(message)
        self.role, self.actor_id = role, actor_id


class PlacementError(RuntimeError):
    """The cluster cannot grant the resources an actor group asked for."""


@dataclass(frozen=True)
class WorkerResources:
    """What each actor of a group reserves: CPU bundles on CPU machines, GPU bundles on GPU ones."""

    num_cpus: float
    num_gpus: float = 0.0
    num_threads: int | None = None

    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.num_cpus}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        return bundle


@dataclass
class _IdleGroup:
    key: Hashable
    name: str
    workers: list[Any]
    pg: PlacementGroup | None  # None: a node-pinned group (no placement group)
    session: str | None = None  # the Ray job (driver connection) it was kept in: its actors die with that connection


def _ray_session() -> str | None:
    """This driver's current Ray connection: its node and job (a new local cluster has a new node id, a reconnection
    to the same cluster a new job id), or None when Ray is not connected."""
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return f"{context.get_node_id()}/{context.get_job_id()}"


@dataclass
class _ActorPool:
    """Idle actor groups kept for the next run of this driver process (see :func:`reuse_actors`)."""

    depth: int = 0  # nested reuse_actors() blocks
    idle: list[_IdleGroup] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.depth > 0

    def forget_other_sessions(self) -> None:
        """Drop the groups kept under another Ray connection (a ``ray.shutdown()`` between two runs, as a sweep that
        changes clusters does): their actors died with it, and their handles are not valid in this one."""
        session = _ray_session()
        self.idle = [g for g in self.idle if g.session == session and session is not None]

    def take(self, key: Hashable) -> _IdleGroup | None:
        self.forget_other_sessions()
        for index, group in enumerate(self.idle):
            if group.key == key:
                return self.idle.pop(index)
        return None

    def evict(self, name: str | None = None, keep_newest: int = 0) -> None:
        """Kill the idle groups of role ``name`` (all of them when ``None``) but the ``keep_newest`` most
        recently kept ones, and release their bundles."""
        self.forget_other_sessions()
        matching = [g for g in self.idle if name is None or g.name == name]
        doomed = matching[: max(0, len(matching) - keep_newest)]
        for group in doomed:
            _kill(group.workers, group.pg)
        doomed_ids = {id(g) for g in doomed}
        self.idle = [g for g in self.idle if id(g) not in doomed_ids]


_POOL = _ActorPool()
#: Idle groups kept per role (shapes of the same role, e.g. two generation engines).
IDLE_GROUPS_PER_ROLE = 2


@contextmanager
def reuse_actors() -> Iterator[None]:
    """Keep actor groups alive between runs inside this block (see the module docstring); when the
    outermost block exits every idle actor is killed. Runs stay exactly reproducible: a kept actor is
    re-initialised as a new one."""
    _POOL.depth += 1
    try:
        yield
    finally:
        _POOL.depth -= 1
        if not _POOL.active:
            _POOL.evict()


@contextmanager
def actors_not_kept() -> Iterator[None]:
    """Inside, a group that shuts down is killed even within :func:`reuse_actors`: the actors of a run the stall
    watchdog aborted, or of a start interrupted, are hung in a call or mid-start (kept, the next run's group waited
    ``placement_timeout_s`` on them, holding their bundles, before starting fresh ones)."""
    depth, _POOL.depth = _POOL.depth, 0
    try:
        yield
    finally:
        _POOL.depth = depth


def _kill(workers: list[Any], pg: PlacementGroup | None) -> None:
    for w in workers:
        ray.kill(w, no_restart=True)
    remove_groups_placed_by(*workers)
    if pg is not None:
        remove_placement_group(pg)


#: Marks the name of a placement group an actor reserved (a judge's engines inside an environment actor) with its
#: creator: Ray keeps such a group until the job ends, not until its creator dies, so a killed or replaced actor's
#: group held its bundles and the replacement could not place its own (the run stopped instead of going on).
_PLACED_BY = "@placed-by-"


def remove_groups_placed_by(*actors: Any) -> None:
    """Remove every placement group ``actors`` reserved (:func:`reserve_bundles` inside them), once they are killed."""
    marks = tuple(f"{_PLACED_BY}{a._actor_id.hex()}" for a in actors if getattr(a, "_actor_id", None) is not None)
    if not marks:
        return
    for info in ray.util.placement_group_table().values():  # one lookup for all of them
        if info.get("name", "").endswith(marks) and info.get("state") != "REMOVED":
            try:
                remove_placement_group(ray.util.get_placement_group(info["name"]))
            except Exception:  # noqa: BLE001 - removed meanwhile
                pass


def actor_scheduling(pg: PlacementGroup | None, rank: int, node_id: str | None) -> Any:
    """Ray scheduling strategy of actor ``rank``: pinned to ``node_id`` when given (the node must run it; no
    placement group), else bundle ``rank`` of ``pg``."""
    if node_id is not None:
        return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    if pg is None:
        raise ValueError("an actor needs a placement group or a node id")
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)


@dataclass(frozen=True)
class RoleResources:
    """What one role of a run reserves: ``count`` actors of ``resources`` each (one bundle per actor).

    Each role states its own next to its code (``policy_resources``, ``generation_resources``, ...); the
    facade starts its group from it and the capacity check adds the roles up."""

    role: str
    count: int
    resources: WorkerResources

    @property
    def bundle(self) -> dict[str, float]:
        return self.resources.bundle()

    def total(self) -> dict[str, float]:
        return {k: v * self.count for k, v in self.bundle.items()}

    def describe(self) -> str:
        return f"{self.role} {self.count} x " + ", ".join(f"{k} {v:g}" for k, v in self.bundle.items())


def release_idle_actors() -> None:
    """Kill the idle groups :func:`reuse_actors` keeps, freeing their bundles. For actors that place groups of their
    own from inside another actor (a judge's engine inside an environment actor): there, this driver's pool cannot
    evict, so a placement would wait for bundles that idle groups hold."""
    _POOL.evict()


def reserve_bundles(name: str, resources: WorkerResources, count: int, timeout_s: float, strategy: str = "PACK") -> PlacementGroup:
    """Create a placement group of ``count`` bundles (Ray placement ``strategy``) and wait for it; fail clearly
    instead of hanging. Idle actors kept by :func:`reuse_actors` are killed first if they hold the resources needed."""
    # A unique name: a kept (idle) group of the same role may still hold its placement group. Reserved inside an actor,
    # it names that actor (remove_groups_placed_by).
    creator = ray.get_runtime_context().get_actor_id()
    owner = f"{_PLACED_BY}{creator}" if creator else ""
    pg = placement_group([resources.bundle()] * count, strategy=strategy, name=f"{name}-{uuid.uuid4().hex[:8]}{owner}")
    try:
        ready, _ = ray.wait([pg.ready()], timeout=min(timeout_s, 2.0) if _POOL.idle else timeout_s)
        if not ready and _POOL.idle:
            _POOL.evict()
            ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    except BaseException:  # Ctrl-C during the wait: a pending group, granted later, would hold its bundles ownerless
        remove_placement_group(pg)
        raise
    if not ready:
        remove_placement_group(pg)
        asked = {k: v * count for k, v in resources.bundle().items()}
        raise PlacementError(
            f"Cannot place '{name}': asked for {count} x {resources.bundle()} = {asked} ({strategy}) within {timeout_s:.0f}s; "
            f"cluster has {_of(ray.cluster_resources(), resources)} in total, {_of(ray.available_resources(), resources)} "
            "available now"
        )
    return pg


def _of(amounts: dict[str, float], resources: WorkerResources) -> dict[str, float]:
    """The entries of ``amounts`` a bundle of ``resources`` asks for (Ray's totals list every placement group's
    internal resources, and memory in bytes, besides)."""
    return {key: amounts.get(key, 0.0) for key in resources.bundle()}


def wait_until_placed(name: str, workers: list[Any], node_id: str, resources: WorkerResources, timeout_s: float) -> None:
    """Wait until every actor of ``workers``, pinned to ``node_id``, has been granted its resources there (its process
    runs; its constructor may still be running); :class:`PlacementError` naming the node and the resources asked and
    available when one is not within ``timeout_s``, or when the node cannot run it at all (it lacks the resource).

    Ray keeps a pinned actor pending for as long as its node lacks free resources (other groups hold them), with no
    timeout of its own: the cluster-wide capacity check passes and setup hung forever on the first call."""
    deadline = time.monotonic() + timeout_s
    evict_at = time.monotonic() + min(timeout_s, 2.0)  # idle kept groups may hold the node's resources, as in reserve_bundles
    pending = list(workers)
    delay = 0.05
    while pending:
        states = [_pinned_state(worker) for worker in pending]
        if any(state == "unplaceable" for state in states):
            raise PlacementError(_pinned_shortfall(name, len(workers), node_id, resources, "the node cannot run it"))
        pending = [worker for worker, state in zip(pending, states) if state == "pending"]
        if pending and _POOL.idle and time.monotonic() >= evict_at:
            _POOL.evict()
        if pending and time.monotonic() >= deadline:
            raise PlacementError(_pinned_shortfall(name, len(workers), node_id, resources, f"not granted within {timeout_s:.0f}s"))
        if pending:
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(2 * delay, 0.5)


def _pinned_state(worker: Any) -> str:
    """``placed`` (a worker process holds the actor), ``pending`` (waiting for resources) or ``unplaceable`` (dead
    before any process held it: its node does not have what it asks for), from the GCS actor table."""
    info = ray._private.state.actors(actor_id=worker._actor_id.hex())  # noqa: SLF001 - the public state API needs the dashboard
    if info.get("Pid") or info.get("State") == "ALIVE":
        return "placed"
    return "unplaceable" if info.get("State") == "DEAD" else "pending"


def _pinned_shortfall(name: str, count: int, node_id: str, resources: WorkerResources, why: str) -> str:
    """The message of a pinned group that could not be placed: node, resources asked, the node's total and free."""
    asked = {k: v * count for k, v in resources.bundle().items()}
    total = ray._private.state.total_resources_per_node().get(node_id, {})  # noqa: SLF001
    free = ray._private.state.available_resources_per_node().get(node_id, {})  # noqa: SLF001
    return (
        f"Cannot place '{name}' on node {node_id} (pinned there): asked for {count} x {resources.bundle()} = {asked}, "
        f"{why}; the node has {_of(total, resources)} in total, {_of(free, resources)} available now (other groups hold the rest)"
    )


class RayWorkerGroup:
    """``num_workers`` actors of ``actor_cls``; each gets ``rank`` and ``world_size`` keyword args."""

    def __init__(
        self,
        name: str,
        actor_cls: type,
        num_workers: int,
        resources: WorkerResources,
        init_kwargs: dict[str, Any],
        placement_timeout_s: float = 60.0,
        env_vars: dict[str, str] | None = None,
        max_concurrency: int = 1,
        strategy: str = "PACK",
        node_id: str | None = None,
    ) -> None:
        """``env_vars`` are added to (and override) each actor's :func:`worker_env_vars`; ``max_concurrency > 1``
        makes threaded actors (methods may run while another call is busy); ``strategy`` is the Ray placement
        strategy of the group's bundles (``cluster.placement_strategy``). ``node_id``: pin every actor to that Ray
        node (no placement group is reserved then; Ray keeps an actor pending while the node lacks its resources)."""
        self.name = name
        self._key: Hashable | None = None
        self._pg: PlacementGroup | None = None
        self.workers: list[Any] = []
        # How each actor is made (a dead one is replaced with the same: :meth:`replace`).
        self._spawn = (actor_cls, num_workers, resources, dict(init_kwargs), env_vars, max_concurrency, node_id)
        if issubclass(actor_cls, Reinitializable):
            # The actor's whole environment (what the driver forwards too: HF_HOME, offline flags, PYTHONPATH), less the
            # thread count a kept actor takes at reinit
            env = self._environment(None if actor_cls.SETS_THREADS_ON_INIT else resources.num_threads)
            env_key = tuple(sorted(env.items()))
            self._key = (
                name,
                actor_cls.__qualname__,
                num_workers,
                replace(resources, num_threads=None) if actor_cls.SETS_THREADS_ON_INIT else resources,
                strategy,
                node_id,  # a kept pinned group serves only a run pinned to the same node
                env_key,
                max_concurrency,
                actor_cls.reuse_key(init_kwargs),
            )
            if self._reuse_idle(num_workers, init_kwargs, placement_timeout_s):
                return
        self._pg = None if node_id is not None else reserve_bundles(name, resources, num_workers, placement_timeout_s, strategy)
        try:  # an actor that cannot start (arguments Ray cannot serialise, Ctrl-C): the bundles were left reserved
            for rank in range(num_workers):
                self.workers.append(self._start(rank))
            if node_id is not None:
                wait_until_placed(name, self.workers, node_id, resources, placement_timeout_s)
        except BaseException:
            self.kill()
            raise

    def _environment(self, num_threads: int | None) -> dict[str, str]:
        """The environment variables each actor of this group starts with."""
        _, _, resources, _, env_vars, _, _ = self._spawn
        env = worker_env_vars(num_threads)
        if not resources.num_gpus:
            # Ray (2.48+) leaves CUDA_VISIBLE_DEVICES alone for an actor given no GPU: on a GPU node it saw every GPU and
            # its torch.cuda.is_available() put the model on cuda:0, a device Ray never gave it. An actor that shares a
            # GPU on purpose (the colocated engine) names its device in env_vars, which win.
            env["CUDA_VISIBLE_DEVICES"] = ""
        return {**env, **(env_vars or {})}

    def _start(self, rank: int) -> Any:
        """A new actor ``rank`` of this group (its bundle of the group's placement group, or the pinned node)."""
        actor_cls, num_workers, resources, init_kwargs, env_vars, max_concurrency, node_id = self._spawn
        options = dict(
            num_cpus=resources.num_cpus,
            num_gpus=resources.num_gpus,
            name=None,
            runtime_env={"env_vars": self._environment(resources.num_threads)},
            scheduling_strategy=actor_scheduling(self._pg, rank, node_id),
            max_concurrency=max_concurrency,
        )
        return ray.remote(actor_cls).options(**options).remote(rank=rank, world_size=num_workers, **init_kwargs)

    def replace(self, rank: int) -> Any:
        """Kill actor ``rank`` (dead or hung) and start a fresh one in its place: the same class, construction arguments,
        resources and bundle (:mod:`nemo_like.distributed.supervision`). ``workers`` is updated in place, so every
        holder of this list sees the new handle. Returns it (its constructor may still be running)."""
        try:
            ray.kill(self.workers[rank], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        remove_groups_placed_by(self.workers[rank])
        self.workers[rank] = self._start(rank)
        return self.workers[rank]

    def wait_started(self, ranks: Sequence[int] | None = None) -> None:
        """Wait until the constructors of ``ranks`` (default: every actor) have run; a constructor that raised fails
        here, naming the group. A call's deadline should start after this, not count an actor's start-up."""
        workers = self.workers if ranks is None else [self.workers[r] for r in ranks]
        get_with_context([w.__ray_ready__.remote() for w in workers], f"{self.name}: start")

    def __len__(self) -> int:
        return len(self.workers)

    def run_all(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call ``method`` with the same arguments on every worker; returns the object refs."""
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def run_sharded(self, method: str, shards: Sequence[Any], **kwargs: Any) -> list[ray.ObjectRef]:
        """Call ``method`` on worker i with ``shards[i]`` as the first argument."""
        if len(shards) != len(self.workers):
            raise ValueError(f"{self.name}: got {len(shards)} shards for {len(self.workers)} workers")
        return [getattr(w, method).remote(shard, **kwargs) for w, shard in zip(self.workers, shards)]

    def run_rank0(self, method: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Call ``method`` on the first worker only."""
        return getattr(self.workers[0], method).remote(*args, **kwargs)

    def _reuse_idle(self, num_workers: int, init_kwargs: dict[str, Any], timeout_s: float) -> bool:
        """Re-initialise an idle group of the same actors (see :func:`reuse_actors`); False if there is none, one
        of its actors died meanwhile, or one does not answer within ``timeout_s`` (a kept actor still busy in a hung
        call of the run before, e.g. one the stall watchdog aborted: the re-initialisation queued behind it forever).
        A threaded actor answers while a call of the last run still runs on its other thread (a generate call the
        run's end left behind): it is re-initialised once that call ends, never under it, or replaced after ``timeout_s``."""
        if not _POOL.active:
            return False
        idle = _POOL.take(self._key)
        if idle is None:
            # Another shape of this role: keep the newest other shape of it too (runs often alternate two,
            # e.g. the HF and the vLLM engine); placement evicts everything idle if it needs the room.
            _POOL.evict(self.name, keep_newest=IDLE_GROUPS_PER_ROLE - 1)
            return False
        try:
            still_busy = _wait_until_idle(idle.workers, time.monotonic() + timeout_s)
            if still_busy is not None:
                print(
                    f"[ray] {self.name}: a kept actor is still in {still_busy} of the last run after {timeout_s:g}s; starting fresh ones",
                    flush=True,
                )
                _kill(idle.workers, idle.pg)
                return False
            refs = [w.reinit.remote(rank=rank, world_size=num_workers, **init_kwargs) for rank, w in enumerate(idle.workers)]
            ray.get(refs, timeout=timeout_s)  # a timeout of its own: waiting for the last call spent none of it
        except ray.exceptions.GetTimeoutError:
            print(f"[ray] {self.name}: a kept actor did not re-initialise within {timeout_s:g}s; starting fresh ones", flush=True)
            _kill(idle.workers, idle.pg)
            return False
        except ray.exceptions.RayActorError:
            _kill(idle.workers, idle.pg)
            return False
        except ray.exceptions.RayTaskError as exc:  # a setting this run's workers refuse, as a fresh actor's start does
            _kill(idle.workers, idle.pg)  # out of the pool: nothing else frees it
            raise WorkerFailure(
                f"a kept {self.name} actor failed during '{self.name}: start' (re-initialised for this run): its constructor "
                f"raised {raised(exc)}",
                role=self.name,
            ) from exc
        except BaseException:
            _kill(idle.workers, idle.pg)
            raise
        self.workers, self._pg = idle.workers, idle.pg
        return True

    def shutdown(self) -> None:
        """Kill the actors and release their bundles (inside :func:`reuse_actors`: keep them idle)."""
        if _POOL.active and self._key is not None and self.workers:
            _POOL.idle.append(_IdleGroup(self._key, self.name, self.workers, self._pg, _ray_session()))
        elif self.workers:
            _kill(self.workers, self._pg)
        self.workers = []

    def kill(self) -> None:
        """Kill the actors and release their bundles, never keeping them idle (a group that failed to set up)."""
        if self.workers or self._pg is not None:
            _kill(self.workers, self._pg)
        self.workers, self._pg = [], None


def _wait_until_idle(workers: Sequence[Any], deadline: float) -> str | None:
    """Wait (until ``deadline``) for every kept actor's calls of the last run to end (``busy_with``: a threaded actor
    answers while a call runs on its other thread); returns what one still does at the deadline, or None. A
    single-threaded actor in a hung call does not answer: ``GetTimeoutError`` at the deadline."""
    while True:
        # at least a second to answer: a threaded actor answers in milliseconds, so a timeout here means a hung one
        busy = [b for b in ray.get([w.busy_with.remote() for w in workers], timeout=max(1.0, deadline - time.monotonic())) if b]
        if not busy:
            return None
        if time.monotonic() + 0.05 >= deadline:
            return busy[0]
        time.sleep(0.05)


def summed_over_workers(workers: Sequence[Any], method: str, what: str) -> Any:
    """The sum of ``method()`` over ``workers`` (a running counter each keeps, e.g. in-flight refits), read with
    :func:`get_with_context` naming ``what``. A dead worker counts 0: its counter died with it, and the next call that
    needs the worker replaces it (its replacement counts from 0); reading a counter must not fail a run that a
    replacement would carry on."""
    total = 0
    for ref in [getattr(w, method).remote() for w in workers]:
        try:
            total += get_with_context(ref, what)
        except WorkerFailure:
            continue
    return total


def get_with_context(refs: Any, what: str, timeout_s: float | None = None) -> Any:
    """``ray.get`` that names the phase and the failing actor when an actor dies, so the error is actionable."""
    start = time.monotonic()
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.RayActorError as exc:
        actor = getattr(exc, "actor_id", None)
        raise WorkerFailure(
            f"Ray actor {actor or '(unknown id)'} died during '{what}' after {time.monotonic() - start:.1f}s: {death_reason(exc)}",
            role=what.split(":")[0].strip(),
            actor_id=actor,
        ) from exc


def raised(exc: ray.exceptions.RayTaskError) -> str:
    """The exception an actor method raised, as one line (``ValueError: ...``), not Ray's remote traceback."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}".splitlines()[0]
    lines = _lines(exc)
    return lines[-1] if lines else type(exc).__name__


def _lines(exc: BaseException) -> list[str]:
    """The non-blank lines of a Ray error's text, stripped (its remote traceback ends with the exception itself)."""
    return [line.strip() for line in str(exc).strip().splitlines() if line.strip()]


def death_reason(exc: BaseException) -> str:
    """One line saying why an actor died. For an error in its constructor Ray forwards the traceback, whose first
    line says only that much: the last line, the exception itself (e.g. a config ``ValueError`` naming its key), is
    what the user needs; for a system-level death (Ray's memory monitor, the kernel's OOM killer, a lost node) the
    first line is Ray's fixed one and the last says why."""
    lines = _lines(exc)
    if not lines:
        return type(exc).__name__
    if "error raised in its creation task" in lines[0] and len(lines) > 1:
        # a pydantic ValidationError (vLLM's configs) ends with a link; the line above it says what was invalid, then
        # echoes the input (" [type=value_error, input_value=...]"); vLLM's lists every architecture it supports
        detail = next(line for line in reversed(lines) if not line.startswith("For further information visit")).split(" [type=")[0]
        return f"its constructor raised {_capped(detail)}"
    if lines[0] == ray.exceptions.ActorDiedError.BASE_ERROR_MSG and len(lines) > 1:
        # Ray's fixed first line of every system-level death: its cause (out of memory, a signal, a lost node) is last
        return _capped(lines[-1])
    return lines[0]


def _capped(line: str, limit: int = 400) -> str:
    """``line``, cut to ``limit`` characters."""
    return line if len(line) <= limit else line[: limit - 3] + "..."
