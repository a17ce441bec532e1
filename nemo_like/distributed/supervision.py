"""Replacing dead generation and environment actors in place, with the same results (issue 30, part 1).

A role's calls go through :func:`gather`: on the normal path one ``ray.get`` (with ``call_timeout_s`` as its
timeout when set), nothing more. When an actor dies under a call (Ray's actor-died error) or does not answer within
``cluster.fault_tolerance.call_timeout_s``, each dead or hung actor is recorded (role, actor, phase, cause), replaced
by a fresh one of the same role (:meth:`~nemo_like.distributed.worker_group.RayWorkerGroup.replace`: the same class,
construction arguments, resources and placement bundle), made ready by its role (:attr:`Replaceable.prepare`: a
generation engine loads the weights the others serve, checked by version), and the lost calls are sent again exactly
as before: the same inputs and the same seeds, so the batch's results are the ones the dead actor would have
returned. The other calls of the batch are not repeated.

Budgets (``cluster.fault_tolerance``): ``max_actor_restarts`` replacements per role over the run, and
``max_retries_per_batch`` re-sends of one batch; a death past either stops the run with
:class:`ActorRestartsExhausted`, listing every death of the run with its cause. The run's :class:`FaultLedger`
(:func:`ledger`, reset by :func:`begin_run`) keeps the counters the loop logs: ``faults/actor_restarts/<role>``,
``faults/retried_batches``, ``faults/seconds_lost``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from nemo_like.distributed.worker_group import WorkerFailure, death_reason, get_with_context


class ActorRestartsExhausted(WorkerFailure):
    """A generation or environment actor died past ``max_actor_restarts`` or ``max_retries_per_batch``: the message
    lists every death of the run (role, actor, phase, cause). Not a death to recover from by restarting the run."""


@dataclass(frozen=True)
class Death:
    """One dead or hung actor, as the error that stops the run lists it."""

    role: str
    actor: str  # "<group> rank <r> (actor <id>)"
    phase: str  # the call it was serving ("generation", "reward", ...)
    cause: str  # one line: Ray's reason, or the missed deadline
    step: int
    attempt: int = 0  # 0: the batch's first dispatch, n: its n-th re-send

    def describe(self) -> str:
        retry = f", re-send {self.attempt}" if self.attempt else ""
        return f"step {self.step}, {self.actor} during '{self.phase}'{retry}: {self.cause}"


@dataclass
class FaultLedger:
    """The run's budgets and what they have been spent on (pure bookkeeping: no Ray)."""

    max_actor_restarts: int = 3
    max_retries_per_batch: int = 2
    call_timeout_s: float | None = None
    deaths: list[Death] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)  # role -> actors replaced
    retried_batches: int = 0
    seconds_lost: float = 0.0

    @classmethod
    def from_config(cls, ft: Any) -> FaultLedger:
        """From ``cluster.fault_tolerance`` (a :class:`~nemo_like.config.sections.run.FaultToleranceConfig`)."""
        return cls(ft.max_actor_restarts, ft.max_retries_per_batch, ft.call_timeout_s)

    def record(self, death: Death) -> None:
        """Count ``death``; raise :class:`ActorRestartsExhausted` when replacing its actor would exceed a budget."""
        self.deaths.append(death)
        if self.restarts.get(death.role, 0) >= self.max_actor_restarts:
            raise ActorRestartsExhausted(self.exhausted_message(f"max_actor_restarts={self.max_actor_restarts} for role '{death.role}'"))
        if death.attempt >= self.max_retries_per_batch:
            raise ActorRestartsExhausted(self.exhausted_message(f"max_retries_per_batch={self.max_retries_per_batch}"))
        self.restarts[death.role] = self.restarts.get(death.role, 0) + 1

    def exhausted_message(self, budget: str) -> str:
        lines = [f"an actor died past cluster.fault_tolerance.{budget}; the run's actor deaths ({len(self.deaths)}):"]
        lines += [f"  {i}. {d.describe()}" for i, d in enumerate(self.deaths, 1)]
        return "\n".join(lines)

    def metrics(self) -> dict[str, float]:
        """The counters, over the run so far; empty until the first death (a run without faults logs none of them)."""
        if not self.deaths:
            return {}
        out = {f"faults/actor_restarts/{role}": float(n) for role, n in sorted(self.restarts.items())}
        out["faults/retried_batches"] = float(self.retried_batches)
        out["faults/seconds_lost"] = self.seconds_lost
        return out


_LEDGER = FaultLedger()


def begin_run(ft: Any | None) -> FaultLedger:
    """A fresh ledger for a run with ``cluster.fault_tolerance`` ``ft`` (``None``: the defaults)."""
    global _LEDGER
    _LEDGER = FaultLedger() if ft is None else FaultLedger.from_config(ft)
    return _LEDGER


def ledger() -> FaultLedger:
    """The current run's ledger."""
    return _LEDGER


@dataclass
class Replaceable:
    """One role's actor group as the supervisor sees it: ``group`` (a
    :class:`~nemo_like.distributed.worker_group.RayWorkerGroup`), the budget's ``role`` and, for roles whose fresh
    actor must be brought up to date before it serves (a generation engine: the weights), ``prepare(worker)``.
    (Inside the async trajectory collector a stand-in with the same ``group``, ``role``, ``describe`` and
    ``replace_dead`` asks the driver, which owns the groups and the budgets.)"""

    role: str
    group: Any
    prepare: Callable[[Any], None] | None = None

    def replace(self, rank: int) -> Any:
        """A fresh actor in place of ``rank``, started (the re-sent call's ``call_timeout_s`` must not count its
        constructor: an environment loading a model for longer was killed as hung, again and again) and made ready
        to serve."""
        worker = self.group.replace(rank)
        self.group.wait_started([rank])
        if self.prepare is not None:
            self.prepare(worker)
        return worker

    def replace_dead(self, rank: int, death: Death) -> Any:
        """Record ``death`` in the run's ledger (raises past a budget), then :meth:`replace`. A replacement is progress:
        the stall watchdog must not abort its recovery (also where the driver serves an async collector's request)."""
        from nemo_like.utils.run_control import run_control

        _LEDGER.record(death)
        print(f"[fault] {death.actor} died during '{death.phase}' ({death.cause}); replacing it", flush=True)
        replacement = self.replace(rank)
        run_control().stage_finished()
        return replacement

    def describe(self, rank: int) -> str:
        worker = self.group.workers[rank]
        actor_id = getattr(worker, "_actor_id", None)
        return f"{self.group.name} rank {rank} (actor {actor_id.hex()[:12] if actor_id is not None else '?'})"


@dataclass(frozen=True)
class Call:
    """One request of a batch: actor ``rank`` of ``target`` serves ``submit(worker) -> ObjectRef``; a re-send calls
    ``submit`` again on the replacement with the same arguments (and so the same seeds)."""

    target: Replaceable
    rank: int
    submit: Callable[[Any], Any]


def dispatch(calls: Sequence[Call]) -> list[Any]:
    """Submit every call; returns the object refs."""
    return [c.submit(c.target.group.workers[c.rank]) for c in calls]


def gather(calls: Sequence[Call], refs: list[Any], what: str) -> list[Any]:
    """The results of ``refs`` (from :func:`dispatch`), in order; a dead or hung actor is replaced and its calls sent
    again (see the module docstring). ``what``: the phase named in errors."""
    timeout = _LEDGER.call_timeout_s
    started = time.monotonic()
    try:
        try:
            return ray.get(list(refs), timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return _recover(calls, list(refs), what, started)
    except ray.exceptions.RayTaskError as exc:  # the actor's own error: raised as it is, each note once
        drop_echoed_notes(exc)
        raise


def drop_echoed_notes(error: BaseException) -> None:
    """Remove from ``error`` (an actor's exception as Ray re-raises it) the notes its message already holds: Ray's
    message is the actor's formatted traceback, notes included, and the notes came along too (each was printed twice)."""
    if notes := getattr(error, "__notes__", None):  # the cause's: Ray's error reads what it lacks from its cause
        message = str(error)
        error.__notes__ = [note for note in notes if note not in message]  # its own, even when empty


def _recover(calls: Sequence[Call], refs: list[Any], what: str, started: float) -> list[Any]:
    from nemo_like.utils.run_control import run_control

    run = _LEDGER
    results: dict[int, Any] = {}
    pending = list(range(len(calls)))
    attempt = 0
    deadline = None if run.call_timeout_s is None else started + run.call_timeout_s
    while True:
        failed: dict[tuple[int, int], str] = {}  # (id of the target, rank) -> cause
        for i in pending:
            try:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                results[i] = ray.get(refs[i], timeout=wait)
            except ray.exceptions.RayActorError as exc:
                failed.setdefault((id(calls[i].target), calls[i].rank), death_reason(exc))
            except ray.exceptions.GetTimeoutError:
                cause = f"no answer within cluster.fault_tolerance.call_timeout_s={run.call_timeout_s:g}s (killed as hung)"
                failed.setdefault((id(calls[i].target), calls[i].rank), cause)
        if not failed:
            if attempt == 0:  # every result arrived just past the deadline: nothing was replaced, nothing re-sent
                return [results[i] for i in range(len(calls))]
            break
        targets = {id(c.target): c.target for c in calls}
        for (target_id, rank), cause in failed.items():
            target = targets[target_id]
            target.replace_dead(rank, Death(target.role, target.describe(rank), what, cause, run_control().step, attempt))
        if attempt == 0:
            run.retried_batches += 1
        attempt += 1
        pending = [i for i in pending if (id(calls[i].target), calls[i].rank) in failed]
        for i in pending:
            refs[i] = calls[i].submit(calls[i].target.group.workers[calls[i].rank])
        deadline = None if run.call_timeout_s is None else time.monotonic() + run.call_timeout_s
    lost = time.monotonic() - started
    run.seconds_lost += lost
    print(f"[fault] '{what}' re-sent to the replaced actor(s): {lost:.1f}s lost", flush=True)
    return [results[i] for i in range(len(calls))]


def gather_or_fail(calls: Sequence[Call] | None, refs: list[Any], what: str) -> list[Any]:
    """:func:`gather` when the calls are replaceable (``calls`` given), else ``get_with_context`` (actors that this
    process cannot replace, e.g. inside the async trajectory collector)."""
    if calls is None:
        return get_with_context(refs, what)
    return gather(calls, refs, what)
