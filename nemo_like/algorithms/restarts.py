"""Run restarts (issue 30, part 2): a dead policy or reference worker restarts the run from its last checkpoint.

A policy rank that dies takes its optimizer shard with it (a reference rank its model), so it cannot be replaced in
place as a generation or environment actor can. The driver (:mod:`nemo_like.train`) then stops every actor of the run,
starts them again from the same config and resumes from the newest checkpoint of this run, in the same process, at
most ``cluster.fault_tolerance.max_restarts`` times. Resume is bitwise (sampling seeds come from
``(grpo.seed, step, batch)``), so the restarted run equals an uninterrupted one: sync runs, and async runs with
``max_trajectory_age_steps`` 0 or 1, the waiting refit and no agent tasks (otherwise which weights generate a step
depends on timing: docs/guides/async-grpo.md). This module holds the decisions:
whose death is restartable (:func:`dead_role`), whether this one may restart (:func:`check_restart`), from which
checkpoint (:func:`restart_checkpoint`), and the lines that say so.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nemo_like.distributed.worker_group import WorkerFailure
from nemo_like.utils.checkpoint import STATE_FILE, CheckpointInfo

#: The roles whose worker's death restarts the run (on a CPU sync run the policy worker also samples; a teacher is a
#: frozen model sharded like the reference).
RESTARTABLE_ROLES = ("policy", "reference", "teacher")
#: The metric counting the restarts so far (in every record logged after the first one).
RESTARTS_METRIC = "faults/run_restarts"


class RunRestartError(WorkerFailure):
    """A policy or reference worker died and the run cannot restart (checkpointing off, or ``max_restarts`` used up);
    the message says why and lists every death's cause."""


@dataclass(frozen=True)
class WorkerDeath:
    """One death of a policy or reference worker: whose, in which step (0: before the first) and the error's text."""

    role: str
    step: int
    cause: str
    error: BaseException | None = field(default=None, compare=False, repr=False)  # the WorkerFailure itself
    at: float = field(default=0.0, compare=False)  # when the driver saw it (time.monotonic)

    def describe(self) -> str:
        return f"{self.role} worker died in step {self.step}: {self.cause.rstrip('.')}"


def dead_role(exc: BaseException, actor_ids: Mapping[str, Collection[str]]) -> str | None:
    """The role of :data:`RESTARTABLE_ROLES` whose worker's death ``exc`` reports, else ``None`` (another role's
    actor, or not an actor's death: the run stops as before).

    ``actor_ids`` maps each role to its actors' ids (hex). The dead actor's id decides when the error carries it (a call
    named after another phase may run on the policy's workers, e.g. ``refit: IPC handles``); else the role the phase
    names does (``policy: training``; a LoRA run's reference, ``reference (policy, adapters disabled)``, runs on the
    policy's workers)."""
    if not isinstance(exc, WorkerFailure) or isinstance(exc, RunRestartError):
        return None
    if exc.actor_id is not None:
        for role, ids in actor_ids.items():
            if exc.actor_id in ids and role in RESTARTABLE_ROLES:
                return role
        if any(ids for ids in actor_ids.values()):
            return None  # another role's actor
    named = (exc.role or "").split(" ")[0]
    return named if named in RESTARTABLE_ROLES else None


def check_restart(death: WorkerDeath, earlier: Sequence[WorkerDeath], max_restarts: int, checkpointing: bool) -> None:
    """Raise :class:`RunRestartError` unless the run may restart after ``death`` (``earlier``: the deaths it already
    restarted after). The budget is checked first: with restarts off, turning checkpointing on would not help."""
    if len(earlier) >= max_restarts:
        deaths = [*earlier, death]
        listed = "; ".join(f"{i}. {d.describe()}" for i, d in enumerate(deaths, 1))
        used = f"after {len(earlier)} restart(s)" if earlier else "with restarts off"
        raise RunRestartError(
            f"a {death.role} worker died {used} (cluster.fault_tolerance.max_restarts={max_restarts}); the run stops. Causes: {listed}"
        ) from death.error
    if not checkpointing:
        raise RunRestartError(
            f"a {death.describe()}. A dead {death.role} rank cannot be replaced in place (its optimizer state and weights "
            "are gone): the run restarts from its last checkpoint, which needs checkpointing.enabled=true (and a "
            "checkpoint: set checkpointing.save_period to bound the steps redone). Checkpointing is off, so the run stops"
        ) from death.error


#: A checkpoint's identity on disk: its ``trainer_state.json``'s (inode, mtime in ns).
Stamp = tuple[int, int]


def checkpoint_stamps(root: Path) -> dict[Path, Stamp]:
    """The identity of each checkpoint under ``root``, taken when a run starts: a checkpoint whose identity differs
    later (new, or saved again, which writes a new file) is this run's. No clocks are compared: a file's mtime comes
    from the kernel's coarse clock and can read earlier than a ``time.time()`` taken just before the file was written."""
    stamps = {state_file.parent: _file_stamp(state_file) for state_file in root.glob(f"step_*/{STATE_FILE}")}
    return {path: stamp for path, stamp in stamps.items() if stamp is not None}


def restart_checkpoint(
    checkpoints: Sequence[CheckpointInfo], at_start: Mapping[Path, Stamp], started_from: CheckpointInfo | None
) -> CheckpointInfo | None:
    """The checkpoint a restart resumes from: the newest one this run wrote (not in ``at_start``, the
    :func:`checkpoint_stamps` taken when the run started, or changed since), else the one the run started from, else
    ``None`` (step 0: the same as a fresh start). Checkpoints that other runs left in the directory
    (``checkpointing.resume=false``) are never taken."""
    candidates = [c for c in checkpoints if (stamp := _file_stamp(c.path / STATE_FILE)) is not None and at_start.get(c.path) != stamp]
    if started_from is not None and started_from.path.is_dir():
        candidates.append(started_from)
    return max(candidates, key=lambda c: c.step, default=None)


def _file_stamp(state_file: Path) -> Stamp | None:
    try:
        stat = state_file.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def restart_line(death: WorkerDeath, attempt: int, max_restarts: int, checkpoint: CheckpointInfo | None) -> str:
    """The ``[restart]`` line: cause, role, step, attempt k of max_restarts and where the run resumes."""
    resumes = f"resuming from {checkpoint.path} (step {checkpoint.step})" if checkpoint else "no checkpoint yet: starting again from step 0"
    return (
        f"[restart] the {death.describe()}; restarting the run's actors (restart {attempt} of "
        f"cluster.fault_tolerance.max_restarts={max_restarts}), {resumes}"
    )
