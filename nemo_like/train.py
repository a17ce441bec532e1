"""Run a whole GRPO job from a validated config: set up, train, summarise, shut down."""

from __future__ import annotations

import os
import shlex
import sys
import time
import warnings
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

from nemo_like.algorithms.checkpointing import find_resume_checkpoint, run_is_complete, trim_metrics_after
from nemo_like.algorithms.grpo import async_grpo_train, grpo_train
from nemo_like.algorithms.names import check_plugin_names
from nemo_like.algorithms.restarts import (
    RESTARTS_METRIC,
    WorkerDeath,
    check_restart,
    checkpoint_stamps,
    dead_role,
    restart_checkpoint,
    restart_line,
)
from nemo_like.algorithms.setup import GRPOComponents, TrainingData, setup_grpo, training_data
from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import MasterConfig
from nemo_like.distributed import faults, supervision
from nemo_like.distributed.ray_env import job_working_dir
from nemo_like.distributed.watchdog import RunStalled, StallWatchdog
from nemo_like.distributed.worker_group import WorkerFailure, actors_not_kept
from nemo_like.models.loading import check_model_source, check_tokenizer_source, refuse_checkpoint_as_model
from nemo_like.utils.checkpoint import CheckpointInfo, CheckpointManager
from nemo_like.utils.deadline import resolve_run_deadline
from nemo_like.utils.log_backends import drop_torn_tail
from nemo_like.utils.logger import Logger
from nemo_like.utils.machine_runs import registered_run
from nemo_like.utils.preflight import clear_refused_run, directories_to_create, ensure_writable_dir, remove_empty_dirs
from nemo_like.utils.run_control import RunControl, RunInterrupted, activate
from nemo_like.utils.run_lock import hold_run_locks, run_directories
from nemo_like.utils.stop_signals import raise_if_stopped, stop_signals_held


def train(cfg: MasterConfig, command_line: list[str] | None = None) -> list[dict[str, Any]]:
    """Train and return the per-step metric records (also in ``<log_dir>/metrics.jsonl``). ``command_line``: the
    command that started the run (the CLI's ``sys.argv``), which a stopped run prints back as the one that resumes it;
    a call from Python code is told to call ``train`` again.

    Before anything starts: the inputs are checked (model source, writable directories) and the run
    locks its log and checkpoint directories, so a second run on them stops before it resumes or trims
    anything (see :mod:`nemo_like.utils.run_lock`).

    SIGTERM, SIGINT and ``checkpointing.save_before`` stop the run after the current step and a checkpoint, raising
    :class:`~nemo_like.utils.run_control.RunInterrupted` (a ``SystemExit``: 143, 130 or 75) after printing how to resume;
    the stall watchdog's abort raises :class:`~nemo_like.distributed.watchdog.RunStalled` (70). See
    docs/guides/fault-tolerance.md."""
    if not isinstance(cfg, MasterConfig):
        raise TypeError(
            f"train() takes a MasterConfig, e.g. load_config('recipe.yaml', ['grpo.max_num_steps=2']); got {type(cfg).__name__}"
        )
    start = time.perf_counter()
    warn_relative_run_dirs_in_a_job(cfg)
    cfg = absolute_run_dirs(cfg)
    created = directories_to_create(run_directories(cfg).values())
    try:
        return _train_checked(cfg, start, command_line, created)
    except ConfigError:  # refused: the directories it created go again, where nothing else has been written into them
        remove_empty_dirs(created)
        raise


def _train_checked(cfg: MasterConfig, start: float, command_line: list[str] | None, created: list[Path]) -> list[dict[str, Any]]:
    """:func:`train` once the run's directories are absolute: the inputs checked, the directories locked, then train;
    ``created``: the directories it creates (:func:`~nemo_like.utils.preflight.directories_to_create`)."""
    check_plugin_names(cfg)  # every plug-in name resolves (and user code imports) before anything is locked or trimmed
    check_run_inputs(cfg)
    deadline, source = resolve_run_deadline(cfg.checkpointing, time.time())  # auto + Slurm + checkpointing off: a ConfigError
    control = RunControl(deadline, saves=cfg.checkpointing.enabled)
    if deadline is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(deadline))
        late = "; it has already passed: the run stops after its first step" if deadline <= time.time() else ""
        print(f"[stop] saving and stopping before {when} ({source}){late}", file=sys.stderr)
    activate(control)
    faults.arm(cfg.cluster.fault_injection)
    control.install_signal_handlers()
    try:
        raise_if_stopped()  # a SIGTERM before the run's handlers whose exception C code swallowed: stop before anything
        with hold_run_locks(run_directories(cfg)), registered_run(cfg.logger.log_dir):
            try:
                return _train_locked(cfg, start, control)
            except ConfigError:  # refused at set-up: what it wrote in the directories it created and locks
                clear_refused_run(d for d in run_directories(cfg).values() if d in created)
                raise
    except RunInterrupted as stop:
        print(stop_message(cfg, stop, command_line), file=sys.stderr, flush=True)
        raise
    except RunStalled:
        print(
            f"nemo-like: error: the run stalled and was aborted (cluster.fault_tolerance.on_stall=abort); {last_checkpoint_line(cfg)}",
            file=sys.stderr,
        )
        raise
    finally:
        control.restore_signal_handlers()
        for spec in faults.disarm():
            print(
                f"[fault] warning: cluster.fault_injection {spec.model_dump(exclude_defaults=False)} did not fire its "
                f"{spec.times} time(s) in this run (no call of that role and phase from step {spec.step} on)",
                file=sys.stderr,
            )
        activate(None)


def absolute_run_dirs(cfg: MasterConfig, cwd: str | Path | None = None) -> MasterConfig:
    """``cfg`` with a relative ``logger.log_dir`` and ``checkpointing.checkpoint_dir`` made absolute against the
    driver's working directory (``cwd``: this process's). Decided here, before any actor sees a path: an actor resolves
    a relative path against its own working directory, which on a joined cluster or in a ``ray job submit`` job is not
    the driver's (policy rank 0 wrote a checkpoint's weights there, and the driver's ``step_N`` had none)."""
    base = Path(os.getcwd() if cwd is None else cwd)

    def absolute(path: str) -> str:
        return str(base / Path(path).expanduser())  # an absolute path stays as it is

    return cfg.model_copy(
        update={
            "logger": cfg.logger.model_copy(update={"log_dir": absolute(cfg.logger.log_dir)}),
            "checkpointing": cfg.checkpointing.model_copy(update={"checkpoint_dir": absolute(cfg.checkpointing.checkpoint_dir)}),
        }
    )


def warn_relative_run_dirs_in_a_job(cfg: MasterConfig, cwd: str | Path | None = None, environ: dict[str, str] | None = None) -> None:
    """Warn about a relative ``logger.log_dir`` / ``checkpointing.checkpoint_dir`` (when enabled) in a ``ray job submit``
    entrypoint with a ``--working-dir``: it resolves against Ray's unpacked copy of it inside its session directory,
    which a new Ray session or a clean-up of the temp dir deletes (with the checkpoints a resubmitted job would resume
    from). A job without one runs where ``ray start`` ran, and an entrypoint that changed directory out of the copy is
    elsewhere: not warned about."""
    base = Path(os.getcwd() if cwd is None else cwd)
    if not job_working_dir(environ) or "working_dir_files" not in base.parts:  # not in Ray's unpacked copy (cd'd out)
        return
    keys = {"logger.log_dir": cfg.logger.log_dir}
    if cfg.checkpointing.enabled:
        keys["checkpointing.checkpoint_dir"] = cfg.checkpointing.checkpoint_dir
    for key, path in keys.items():
        if not Path(path).expanduser().is_absolute():
            print(
                f"[setup] warning: {key}={path!r} is relative: in this Ray job it is {base / path}, under the job's "
                "working directory (Ray's unpacked copy, inside its session directory, which a new Ray session or a "
                "clean-up of its temp dir deletes); give an absolute path on storage that outlives the job",
                file=sys.stderr,
            )


def check_run_inputs(cfg: MasterConfig) -> None:
    """Before any cluster or actor starts: model and tokenizer sources loadable here, run directories writable
    (a :class:`~nemo_like.config.errors.ConfigError` naming the key otherwise)."""
    check_model_source(cfg.policy.model_name, "policy.model_name")
    refuse_checkpoint_as_model(cfg.policy.model_name, "policy.model_name")
    check_tokenizer_source(cfg, model_checked=True)
    if cfg.teacher.model_name is not None:
        check_model_source(cfg.teacher.model_name, "teacher.model_name")
        refuse_checkpoint_as_model(cfg.teacher.model_name, "teacher.model_name", trained=False)
    for task, name in cfg.teacher.by_task.items():  # a typo there was a traceback (an unknown embedded: name) or blamed
        if name is not None:  # teacher.model_name
            check_model_source(name, f"teacher.by_task.{task}")
            refuse_checkpoint_as_model(name, f"teacher.by_task.{task}", trained=False)
    for key, directory in run_directories(cfg).items():
        ensure_writable_dir(directory, key)


def stop_message(cfg: MasterConfig, stop: RunInterrupted, command_line: list[str] | None = None) -> str:
    """The lines a stopped run ends with: why, what was saved, the exit status and the exact command that resumes
    (``command_line``: the CLI's; without one, a Python caller's, how to resume from code)."""
    if stop.checkpoint:
        saved = f"checkpoint {stop.checkpoint}"
    elif cfg.checkpointing.enabled:  # e.g. a policy death after the signal, before the first save
        saved = "no checkpoint written yet"
    else:
        saved = "no checkpoint (checkpointing.enabled=false)"
    line = f"[stop] stopped after step {stop.step} ({stop.reason.what}); {saved}; exit status {stop.reason.status}"
    if stop.checkpoint:
        latest = find_resume_checkpoint_quietly(cfg)
        if latest is not None and Path(latest).resolve() != Path(stop.checkpoint).resolve():  # a later one, another run's
            return line + (
                f"\n[stop] a rerun would resume from {latest}, not from this run's checkpoint: it is the latest in "
                "checkpointing.checkpoint_dir (another run's). Move the other run's step_* directories away, or copy this "
                "run's checkpoint to a new checkpointing.checkpoint_dir, before resuming"
            )
        if command_line is None:  # train() called from Python code: its script may not read its arguments as the CLI does
            resume = "" if cfg.checkpointing.resume else " with checkpointing.resume=true"
            return (
                line
                + f"\n[stop] resume: call train() again on this config{resume} (checkpointing.checkpoint_dir {cfg.checkpointing.checkpoint_dir})"
            )
        return line + f"\n[stop] resume with: {resume_command(cfg, command_line)}"
    if cfg.checkpointing.enabled:
        return line + "\n[stop] a rerun starts from step 0"
    return line + "\n[stop] a rerun starts afresh: set checkpointing.enabled=true to make runs resumable"


def resume_command(cfg: MasterConfig, argv: list[str]) -> str:
    """The CLI command line ``argv`` that started the run (it resumes: ``checkpointing.resume`` is on by default), with
    ``checkpointing.resume=true`` appended when it was turned off."""
    args = list(argv)
    name = Path(args[0]).name
    if name in ("cli.py", "__main__.py"):
        head = [sys.executable, "-m", "nemo_like.cli"]
    else:
        head = [args[0]] if name == "nemo-like" else [sys.executable, args[0]]
    extra = [] if cfg.checkpointing.resume else ["checkpointing.resume=true"]
    return shlex.join([*head, *args[1:], *extra])


def last_checkpoint_line(cfg: MasterConfig) -> str:
    """Where the next start resumes from, for an aborted run."""
    if not cfg.checkpointing.enabled:
        return "checkpointing is off: a rerun starts afresh"
    latest = find_resume_checkpoint_quietly(cfg)
    return f"the next start resumes from {latest}" if latest else "no checkpoint yet: a rerun starts afresh"


def find_resume_checkpoint_quietly(cfg: MasterConfig) -> str | None:
    """The latest complete checkpoint's path, without removing anything."""
    latest = CheckpointManager(cfg.checkpointing.checkpoint_dir).latest()
    return None if latest is None else str(latest.path)


def _train_locked(cfg: MasterConfig, start: float, control: RunControl) -> list[dict[str, Any]]:
    """Train; a dead policy or reference worker restarts the run from its last checkpoint in this process, at most
    ``cluster.fault_tolerance.max_restarts`` times (:mod:`nemo_like.algorithms.restarts`)."""
    started_from = resume_from = find_resume_checkpoint(cfg)
    if resume_from is not None and run_is_complete(cfg, resume_from):  # a rerun of a finished run: start nothing
        print(
            f"[checkpoint] {resume_from.path} is at grpo.max_num_steps={cfg.grpo.max_num_steps}: the run is complete, "
            "nothing to train. Raise grpo.max_num_steps to train on, or use another checkpointing.checkpoint_dir to start afresh",
            file=sys.stderr,
        )
        return []
    at_start = checkpoint_stamps(Path(cfg.checkpointing.checkpoint_dir))  # the checkpoints that are not this run's
    metrics_path = Path(cfg.logger.log_dir) / "metrics.jsonl"
    replay = None  # the checkpoint run's records written again after another run's (and given to the dashboards)
    data = None  # the prompts, built here when resuming: changed ones are refused before Ray starts or the log is trimmed
    if resume_from is not None:
        data = training_data(cfg)
        data.loader.check_resumable(resume_from.state["dataloader"])
        # steps logged after the checkpoint are redone: drop their records
        if replay := trim_metrics_after(metrics_path, resume_from.step):
            print(replay.note, flush=True)
    # What earlier runs logged, without a torn last line (a run killed mid-write): this run's log cuts it off, so a
    # restart that kept the file up to an offset counting it kept part of this run's first record.
    drop_torn_tail(metrics_path)
    metrics_start = metrics_path.stat().st_size if metrics_path.exists() else 0
    deaths: list[WorkerDeath] = []
    supervision.begin_run(cfg.cluster.fault_tolerance)  # actor replacements: one budget over every restarted attempt
    kept: list[dict[str, Any]] = []  # records of the attempts before a restart, up to the step it resumed from
    resumed_step = resume_from.step if resume_from is not None else None  # None: a fresh start
    while True:
        replayed = replay.records if replay and not deaths else ()
        logger = Logger(cfg.logger, cfg.grpo.max_num_steps, resumed_step, replayed, elapsed_s=time.perf_counter() - start)
        if deaths:
            logger.extra[RESTARTS_METRIC] = float(len(deaths))
            report_first_step(logger, deaths[-1], len(deaths))
        outcome = _train_attempt(cfg, start, control, resume_from, logger, deaths, data)
        data = None  # a restart builds its prompts afresh (the loader moved on)
        if not isinstance(outcome, WorkerDeath):
            history = kept + outcome
            break
        manager = CheckpointManager(cfg.checkpointing.checkpoint_dir)
        stop = control.stop_reason(restarting=True)
        if stop is not None:  # asked to stop (a signal, the deadline): restarting would spend the grace time on setup
            latest = restart_checkpoint(manager.valid_checkpoints(), at_start, started_from) if cfg.checkpointing.enabled else None
            print(f"[restart] the {outcome.describe()}; not restarting: the run was asked to stop ({stop.what})", file=sys.stderr)
            raise RunInterrupted(stop, max(outcome.step - 1, 0), None if latest is None else str(latest.path)) from outcome.error
        check_restart(outcome, deaths, cfg.cluster.fault_tolerance.max_restarts, cfg.checkpointing.enabled)
        deaths.append(outcome)
        for path in manager.remove_partial_saves():
            print(f"[checkpoint] removed an interrupted save: {path}", file=sys.stderr)
        resume_from = restart_checkpoint(manager.valid_checkpoints(), at_start, started_from)
        resumed_step = resume_from.step if resume_from is not None else -1  # -1: nothing this run logged is kept
        trim_metrics_after(metrics_path, resumed_step, from_byte=metrics_start)
        kept = [r for r in kept + logger.records if r["step"] <= resumed_step]
        print(restart_line(outcome, len(deaths), cfg.cluster.fault_tolerance.max_restarts, resume_from), file=sys.stderr, flush=True)
    control.run_finished()  # a signal from here on stops nothing: the status stays 0
    print(summarise(history, time.perf_counter() - start), file=sys.stderr)
    if cfg.logger.plot_at_end:
        write_plot(logger.metrics_path)
    return history


def _train_attempt(
    cfg: MasterConfig,
    start: float,
    control: RunControl,
    resume_from: CheckpointInfo | None,
    logger: Logger,
    deaths: list[WorkerDeath],
    data: TrainingData | None = None,
) -> list[dict[str, Any]] | WorkerDeath:
    """Set the run up and train: the records, or the :class:`WorkerDeath` of a policy or reference worker (every actor of
    the attempt is stopped either way; any other error propagates). ``data``: the prompts, when already built."""
    since = time.perf_counter() if deaths else start
    control.attempt_started()
    logger.save_config(cfg.model_dump(mode="json"))
    logger.progress.message(f"[setup] logging to {logger.metrics_path}")
    ft = cfg.cluster.fault_tolerance
    with ExitStack() as watch:  # the start has a watchdog of its own (setup_timeout_s): a hung one hung the run silently
        try:
            # The prompts first, outside the watchdog and the held signals: reading and tokenising a large set is the
            # driver's own work, no stall (a 200k-row file was aborted by setup_timeout_s=15); a stop asked meanwhile
            # ends the run here, before Ray starts (it trained a whole step first).
            data = data or training_data(cfg)
            if (stop := control.requested) is not None:
                raise RunInterrupted(stop, resume_from.step if resume_from else 0, str(resume_from.path) if resume_from else None)
            # Ray's processes inherit the mask: a signal to the group spares them
            with stop_signals_held(control.install_signal_handlers) as release:
                control.last_progress = time.monotonic()
                if ft.setup_timeout_s:  # started under the mask: its thread never takes a stop signal (see the helper)
                    watch.enter_context(StallWatchdog(control, ft.setup_timeout_s, ft.on_stall, "setup_timeout_s", "set-up"))
                parts = setup_grpo(cfg, ray_started=release, data=data)  # bad data fails here, before any actor starts
        except WorkerFailure as exc:
            logger.close(failed=True)
            # A restart's workers can die while they start (the last attempt's memory not yet freed): that is a death as
            # any other, within the restart budget. A failure of the first start is not: the run stops (setup_grpo has
            # stopped the actors it started either way).
            role = dead_role(exc, {}) if deaths else None
            if role is None:
                raise
            return WorkerDeath(role, control.step, str(exc), exc, time.monotonic())
        except RunInterrupted as stopped:  # asked to stop while the prompts loaded: resumable from its checkpoint, as after a step
            logger.close(failed=stopped.checkpoint is None)
            raise
        except BaseException:
            logger.close(failed=True)
            raise
    control.setup_finished(time.perf_counter() - since)  # a restart near a deadline must budget for another start
    ready = f"[setup] actors ready in {time.perf_counter() - since:.1f}s"
    logger.progress.message(ready if not deaths else ready + f" (restart {len(deaths)})")
    actor_ids = restartable_actor_ids(parts)
    stalled = False
    failed = True  # until the loop returns or stops as asked: an error, a stall or a worker's death is a failure
    try:
        with ExitStack() as stack:
            control.last_progress = time.monotonic()
            if ft.stall_timeout_s:
                stack.enter_context(StallWatchdog(control, ft.stall_timeout_s, ft.on_stall))
            loop = async_grpo_train if cfg.grpo.async_grpo.enabled else grpo_train
            history = loop(parts, logger, resume_from)
            failed = False
            return history
    except RunInterrupted as stop:  # a stop (a signal, the deadline): the run ended as asked, a success once saved
        failed = stop.checkpoint is None
        raise
    except RunStalled:
        stalled = True
        raise
    except WorkerFailure as exc:
        role = dead_role(exc, actor_ids)
        if role is None:
            raise
        return WorkerDeath(role, control.step, str(exc), exc, time.monotonic())
    finally:
        logger.close(failed=failed)
        with actors_not_kept() if stalled else nullcontext():  # a stalled run's actors are hung: never kept for another
            parts.shutdown()  # the actors (a dead one included), their placement groups, refit buffers, the rollout server


def report_first_step(logger: Logger, death: WorkerDeath, restarts: int) -> None:
    """Print, with the first step the restarted run logs, how long after the death it came."""
    log = logger.log

    def log_and_report(metrics: dict[str, Any], step: int) -> dict[str, Any]:
        record = log(metrics, step)
        if step > 0 and logger.log is log_and_report:
            logger.log = log  # type: ignore[method-assign]
            seconds = time.monotonic() - death.at
            logger.progress.message(f"[restart] step {step} done {seconds:.1f}s after the death (restart {restarts})")
        return record

    logger.log = log_and_report  # type: ignore[method-assign]


def restartable_actor_ids(parts: GRPOComponents) -> dict[str, set[str]]:
    """The Ray actor ids of the policy's, the reference's and the teachers' workers (a LoRA run's reference has none
    of its own)."""
    ids: dict[str, set[str]] = {}
    teachers = list(parts.teacher.models.values()) if parts.teacher is not None else []
    for role, part in (("policy", parts.policy), ("reference", parts.reference), *(("teacher", t) for t in teachers)):
        group = getattr(part, "group", None)
        if group is not None:
            ids.setdefault(role, set()).update(worker._actor_id.hex() for worker in group.workers)
    return ids


def write_plot(metrics_path: Path) -> Path | None:
    """Render the standard metrics panel beside the logs and print its path; a failure only warns."""
    try:
        from nemo_like.utils.plot import plot_metrics

        path = plot_metrics(metrics_path)
    except Exception as exc:  # noqa: BLE001 - the run already succeeded; a missing plot must not fail it
        warnings.warn(f"could not plot {metrics_path} ({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)
        return None
    print(f"[done] plot: {path}", file=sys.stderr)
    return path


def summarise(history: list[dict[str, Any]], seconds: float) -> str:
    """Validation accuracy at the first and last validated step, and the wall time."""
    val = [(h["step"], h["validation/accuracy"]) for h in history if "validation/accuracy" in h]
    line = f"[done] {len(history)} records in {seconds:.0f}s"
    if len(val) >= 2:
        (s0, a0), (s1, a1) = val[0], val[-1]
        line += f"; validation/accuracy {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1}), {100 * (a1 - a0):+.1f} points"
    return line
