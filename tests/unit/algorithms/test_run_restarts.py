"""Run restarts after a dead policy or reference worker: the decisions (nemo_like/algorithms/restarts.py), the metrics
trim, and the driver's loop (nemo_like/train.py) with the attempts faked (no Ray)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nemo_like import train as train_module
from nemo_like.algorithms.checkpointing import trim_metrics_after
from nemo_like.algorithms.restarts import RunRestartError, WorkerDeath, check_restart, checkpoint_stamps, dead_role, restart_checkpoint
from nemo_like.config import load_config
from nemo_like.config.schema import LoggerConfig
from nemo_like.distributed.worker_group import WorkerFailure
from nemo_like.utils.checkpoint import CheckpointInfo
from nemo_like.utils.logger import Logger
from nemo_like.utils.plot import read_metrics
from nemo_like.utils.run_control import RunControl, RunInterrupted, StopReason

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_tiny_cpu.yaml"
IDS = {"policy": {"p0", "p1"}, "reference": {"r0"}}


def died(what: str, actor_id: str | None) -> WorkerFailure:
    return WorkerFailure(f"Ray actor {actor_id} died during '{what}'", role=what.split(":")[0].strip(), actor_id=actor_id)


def test_a_policy_or_reference_death_is_restartable_and_others_are_not():
    assert dead_role(died("policy: training", "p1"), IDS) == "policy"
    assert dead_role(died("reference: logprobs", "r0"), IDS) == "reference"
    assert dead_role(died("refit: IPC handles", "p0"), IDS) == "policy"  # a call on the policy's workers, named otherwise
    assert dead_role(died("teacher logprobs (embedded:tiny-arith-teacher)", "t0"), {**IDS, "teacher": {"t0"}}) == "teacher"
    assert dead_role(died("generation", "g0"), IDS) is None  # another role's actor: replaced in place, or the run stops
    assert dead_role(died("policy: training", "g0"), IDS) is None  # the actor id decides when known
    assert dead_role(died("policy: inline generation", None), IDS) == "policy"  # else the phase's role
    assert dead_role(died("reference (policy, adapters disabled): reference logprobs", None), {}) == "reference"
    assert dead_role(WorkerFailure("the trajectory collector failed"), IDS) is None
    assert dead_role(RunRestartError("out of restarts", role="policy"), IDS) is None
    assert dead_role(RuntimeError("policy: training"), IDS) is None


def test_a_restart_needs_checkpointing_and_stops_past_max_restarts_listing_every_cause():
    cause = died("policy: training", "p0")
    first, second = WorkerDeath("policy", 5, "first cause", cause), WorkerDeath("reference", 7, "second cause", cause)
    check_restart(first, [], max_restarts=2, checkpointing=True)
    check_restart(second, [first], max_restarts=2, checkpointing=True)
    with pytest.raises(RunRestartError, match=r"policy worker died in step 5: first cause.*checkpointing.enabled=true") as off:
        check_restart(first, [], max_restarts=2, checkpointing=False)
    assert off.value.__cause__ is cause
    with pytest.raises(RunRestartError, match=r"after 1 restart\(s\) \(cluster.fault_tolerance.max_restarts=1\)") as out:
        check_restart(second, [first], max_restarts=1, checkpointing=True)
    assert "1. policy worker died in step 5: first cause; 2. reference worker died in step 7: second cause" in str(out.value)
    with pytest.raises(RunRestartError, match="with restarts off"):
        check_restart(first, [], max_restarts=0, checkpointing=True)
    with pytest.raises(RunRestartError, match="with restarts off"):  # not "turn checkpointing on": that would not help
        check_restart(first, [], max_restarts=0, checkpointing=False)


def checkpoint(root: Path, step: int) -> CheckpointInfo:
    path = root / f"step_{step}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "trainer_state.json.tmp").write_text(json.dumps({"step": step}))
    (path / "trainer_state.json.tmp").replace(path / "trainer_state.json")  # a new file, as a save writes
    return CheckpointInfo(step, path, {"step": step})


def test_a_restart_resumes_from_this_runs_newest_checkpoint_else_the_one_it_started_from(tmp_path):
    old_later_run = checkpoint(tmp_path, 9)  # left by another run (checkpointing.resume=false): never taken
    started = checkpoint(tmp_path, 3)
    at_start = checkpoint_stamps(tmp_path)
    assert set(at_start) == {old_later_run.path, started.path}
    assert restart_checkpoint([started, old_later_run], at_start, started) is started
    assert restart_checkpoint([started, old_later_run], at_start, None) is None  # step 0, as a fresh start
    own = checkpoint(tmp_path, 4)  # written at once: no clock tick between the run's start and this save
    assert restart_checkpoint([started, own, old_later_run], at_start, started) is own
    checkpoint(tmp_path, 9)  # this run saved step_9 again over the other run's
    assert restart_checkpoint([started, own, old_later_run], at_start, started) is old_later_run


def test_trimming_metrics_keeps_earlier_runs_bytes_and_drops_later_steps_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    earlier = "".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 7))  # another run's records stay as they are
    path.write_text(earlier + "".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2, 3)) + '{"step": 4, "x')
    trim_metrics_after(path, 2, from_byte=len(earlier))
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 7, 0, 1, 2]
    trim_metrics_after(path, -1, from_byte=len(earlier))  # a restart from step 0 drops all this run logged
    assert path.read_text() == earlier


def test_a_resume_trims_only_the_last_run_of_a_shared_metrics_file(tmp_path):
    """A log_dir holding an earlier, longer run (steps 1-7) and this run's steps 0-4: resuming this run from its step-2
    checkpoint drops this run's steps 3-4 only (the whole file was trimmed: the earlier run lost its steps 3-7)."""
    path = tmp_path / "metrics.jsonl"
    earlier = "".join(json.dumps({"step": s, "run": "a"}) + "\n" for s in range(1, 8))
    path.write_text(earlier + "".join(json.dumps({"step": s, "run": "b"}) + "\n" for s in (0, 1, 2, 2, 3, 4)))
    trim_metrics_after(path, 2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["run"], r["step"]) for r in records] == [("a", s) for s in range(1, 8)] + [("b", s) for s in (0, 1, 2, 2)]
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "x')  # one run, torn
    trim_metrics_after(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_resuming_after_another_run_logged_in_the_same_dir_continues_the_checkpoints_own_run(tmp_path):
    """Run A logged 0-10 and saved step 10; run B (a short one, no checkpoints) then logged 0-5 in the same log_dir.
    Resuming A kept B's records as if they were A's: the plot's last run read B 0-5 then A 11, 12."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "run": r}) + "\n" for r, steps in (("A", range(11)), ("B", range(6))) for s in steps))
    replay = trim_metrics_after(path, 10)
    assert replay is not None and "another run logged steps 0-5 here after the checkpoint's run" in replay.note
    assert [(r["run"], r["step"]) for r in replay.records] == [("A", s) for s in range(11)]
    with path.open("a") as f:
        f.writelines(json.dumps({"step": s, "run": "A"}) + "\n" for s in (11, 12))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["run"], r["step"]) for r in records[11:17]] == [("B", s) for s in range(6)]  # the other run, whole
    assert [(r["run"], r["step"]) for r in read_metrics(path)] == [("A", s) for s in range(13)]  # the last run: A's own
    assert trim_metrics_after(path, 12) is None  # resuming again: the last run is the checkpoint's


def test_tensorboard_of_a_resume_after_another_run_shows_the_checkpoints_own_run(tmp_path, monkeypatch):
    """As above, with the dashboards: TensorBoard hid only the steps after the checkpoint, so it drew run B's steps 0-5
    (B hid A's) and then A's 11-12. The resumed run's logger hides every earlier step and logs A's records again.
    The three event files are the process's 8th to 10th: made in one second, the 10th's name sorted first (a flake of
    the suite, where a worker's count passed 9 there), and TensorBoard read the purge before the run it hides."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(8))

    cfg = LoggerConfig(log_dir=str(tmp_path), tensorboard_enabled=True, progress_bar=False)
    for run, last in (("A", 10), ("B", 5)):
        logger = Logger(cfg, total_steps=last)
        for step in range(last + 1):
            logger.log({"train/reward": (1.0 if run == "A" else -1.0) * step}, step=step)
        logger.close()
    replay = trim_metrics_after(tmp_path / "metrics.jsonl", 10)
    assert replay is not None
    logger = Logger(cfg, total_steps=12, resumed_step=10, replayed=replay.records)
    for step in (11, 12):
        logger.log({"train/reward": float(step)}, step=step)
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/reward")] == [(s, float(s)) for s in range(13)]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(13))  # replayed once, not twice


def fake_run(tmp_path: Path, monkeypatch, attempts, *overrides: str, control: RunControl | None = None):
    """``train._train_locked`` with each attempt replaced by ``attempts[i](logger, resume_from)``."""
    cfg = load_config(
        RECIPE,
        [f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "logger.progress_bar=false"]
        + ["logger.plot_at_end=false", *overrides],
    )
    calls = iter(attempts)
    seen = []

    def attempt(cfg, start, control, resume_from, logger, deaths, data=None):
        seen.append(resume_from.step if resume_from else 0)
        try:
            return next(calls)(logger, resume_from)
        finally:
            logger.close()

    monkeypatch.setattr(train_module, "_train_attempt", attempt)
    return train_module._train_locked(cfg, time.perf_counter(), control or RunControl()), seen


def logs(*steps: int, death_step: int | None = None):
    def attempt(logger, resume_from):
        for step in steps:
            logger.log({"train/reward": float(step)}, step)
        if death_step is None:
            return [dict(r) for r in logger.records]
        return WorkerDeath("policy", death_step, f"killed in step {death_step}", died("policy: training", "p0"))

    return attempt


def test_the_driver_restarts_from_step_0_without_a_checkpoint_and_logs_each_step_once(tmp_path, monkeypatch, capsys):
    history, seen = fake_run(
        tmp_path, monkeypatch, [logs(0, 1, 2, death_step=3), logs(0, 1, 2, 3)], "checkpointing.enabled=true", "grpo.max_num_steps=3"
    )
    assert seen == [0, 0]
    assert (
        "[restart] the policy worker died in step 3: killed in step 3; restarting the run's actors (restart 1 of" in capsys.readouterr().err
    )
    lines = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3] == [h["step"] for h in history]
    assert all(r["faults/run_restarts"] == 1.0 for r in lines)
    assert [r.get("run_start") for r in lines] == [True, None, None, None]  # the restart begins the run again


def test_a_run_restarted_from_step_0_still_begins_a_run_of_its_own_in_a_shared_log_dir(tmp_path, monkeypatch):
    """A restart without a checkpoint trims its first attempt's records, run_start included; its new logger, a resume
    of step -1, did not mark its first record: after a 1-step run in the same log_dir, the restart read as that run's."""
    from nemo_like.algorithms.checkpointing import last_run_start
    from nemo_like.utils.plot import read_metrics

    fake_run(tmp_path / "a", monkeypatch, [logs(0, 1)], "grpo.max_num_steps=1", f"logger.log_dir={tmp_path / 'shared'}")
    size = (tmp_path / "shared" / "metrics.jsonl").stat().st_size
    fake_run(
        tmp_path / "b", monkeypatch, [logs(1, death_step=2), logs(1, 2)], "checkpointing.enabled=true", "grpo.max_num_steps=2",
        f"logger.log_dir={tmp_path / 'shared'}",
    )  # fmt: skip
    path = tmp_path / "shared" / "metrics.jsonl"
    assert [r["step"] for r in read_metrics(path)] == [1, 2] and last_run_start(path.read_bytes()) == size


def test_a_restart_after_an_earlier_runs_torn_last_line_keeps_this_runs_records_whole(tmp_path, monkeypatch):
    """An earlier run in the log dir was killed mid-write. Where this run began was measured with the torn bytes, which
    its log then cut off: a restart kept the file up to that offset, inside this run's first record (its rest dropped,
    the next record glued on: the file no longer parsed)."""
    from nemo_like.algorithms.checkpointing import last_run_start

    path = tmp_path / "logs" / "metrics.jsonl"
    path.parent.mkdir()
    earlier = json.dumps({"step": 1, "run_start": True, "train/reward": 0.5}) + "\n"
    path.write_text(earlier + '{"step": 2, "train/rew')
    first = logs(0, 1, 2, 3, death_step=4)

    def saves_step_2_then_dies(logger, resume_from):
        checkpoint(tmp_path / "ckpt", 2)
        return first(logger, resume_from)

    history, seen = fake_run(
        tmp_path, monkeypatch, [saves_step_2_then_dies, logs(3, 4)], "checkpointing.enabled=true", "grpo.max_num_steps=4"
    )
    assert seen == [0, 2] and [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3, 4] == [h["step"] for h in history]
    text = path.read_text()
    assert text.startswith(earlier) and last_run_start(path.read_bytes()) == len(earlier)
    assert [json.loads(line)["step"] for line in text.splitlines()] == [1, 0, 1, 2, 3, 4]


def test_the_driver_stops_with_a_clear_error_when_checkpointing_is_off_or_restarts_run_out(tmp_path, monkeypatch):
    with pytest.raises(RunRestartError, match=r"needs checkpointing.enabled=true") as off:
        fake_run(tmp_path / "off", monkeypatch, [logs(1, death_step=2)], "checkpointing.enabled=false")
    assert "killed in step 2" in str(off.value)
    with pytest.raises(RunRestartError, match=r"max_restarts=1\); the run stops. Causes: 1\. .*step 2.*; 2\. .*step 1"):
        fake_run(
            tmp_path / "out",
            monkeypatch,
            [logs(1, death_step=2), logs(death_step=1)],
            "checkpointing.enabled=true",
            "cluster.fault_tolerance.max_restarts=1",
        )


def test_a_death_after_a_stop_request_stops_the_run_instead_of_restarting_it(tmp_path, monkeypatch, capsys):
    """A SIGTERM (preemption's grace period) then a dead policy worker: the run stops with the signal's status and
    names its last checkpoint; it used to restart every actor first and honour the stop only after a resumed step."""
    control = RunControl()
    control.requested = StopReason("SIGTERM", 143)

    def saved_then_died(logger, resume_from):
        step_2 = tmp_path / "ckpt" / "step_2"
        step_2.mkdir(parents=True)
        (step_2 / "trainer_state.json").write_text(json.dumps({"step": 2, "metrics": {}}))
        return logs(1, 2, death_step=3)(logger, resume_from)

    with pytest.raises(RunInterrupted) as stopped:
        fake_run(tmp_path, monkeypatch, [saved_then_died, logs(3)], "checkpointing.enabled=true", control=control)
    assert (stopped.value.code, stopped.value.step, stopped.value.checkpoint) == (143, 2, str(tmp_path / "ckpt" / "step_2"))
    assert "[restart] the policy worker died in step 3: killed in step 3; not restarting: the run was asked to stop (SIGTERM)" in (
        capsys.readouterr().err
    )


def test_a_stop_without_a_checkpoint_says_checkpointing_is_off_only_when_it_is(tmp_path):
    """A death after SIGTERM before the first save, checkpointing on: the message said 'checkpointing.enabled=false'
    and told the user to turn on what was already on."""
    stop = RunInterrupted(StopReason("SIGTERM", 143), 1, None)
    on = load_config(RECIPE, ["checkpointing.enabled=true", f"checkpointing.checkpoint_dir={tmp_path}"])
    message = train_module.stop_message(on, stop)
    assert "enabled=false" not in message and "set checkpointing.enabled=true" not in message
    assert "no checkpoint written yet" in message and "a rerun starts from step 0" in message
    off = load_config(RECIPE, ["checkpointing.enabled=false", f"checkpointing.checkpoint_dir={tmp_path}"])
    assert "no checkpoint (checkpointing.enabled=false)" in train_module.stop_message(off, stop)


def test_a_stop_whose_checkpoint_is_not_the_latest_prints_no_resume_command(tmp_path):
    """A checkpointing.resume=false run beside another run's later checkpoints: its stop message named its own step_20
    and printed a command that resumed from the other run's step_100 (a resume takes the latest)."""
    for step in (80, 100):
        checkpoint(tmp_path, step)
    own = checkpoint(tmp_path, 20)
    cfg = load_config(RECIPE, ["checkpointing.enabled=true", "checkpointing.resume=false", f"checkpointing.checkpoint_dir={tmp_path}"])
    message = train_module.stop_message(cfg, RunInterrupted(StopReason("SIGTERM", 143), 20, str(own.path)))
    assert f"checkpoint {own.path}" in message and "resume with" not in message
    assert f"a rerun would resume from {tmp_path / 'step_100'}, not from this run's checkpoint" in message
    latest = checkpoint(tmp_path, 120)  # the run's own checkpoint is the latest: the command resumes it
    stopped = RunInterrupted(StopReason("SIGTERM", 143), 120, str(latest.path))
    message = train_module.stop_message(cfg, stopped, ["/venv/bin/nemo-like", "train", "--config", "r.yaml"])
    assert message.endswith("[stop] resume with: /venv/bin/nemo-like train --config r.yaml checkpointing.resume=true")
    # train() called from a script or a notebook: its argv is not a command that resumes (a script may ignore it)
    message = train_module.stop_message(cfg, stopped)
    assert "resume with" not in message and "[stop] resume: call train() again on this config with checkpointing.resume=true" in message


def test_a_resumed_runs_tensorboard_hides_the_steps_it_redoes(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nemo_like.utils.log_backends import TensorBoardBackend

    first = TensorBoardBackend(tmp_path)
    for step in range(1, 6):
        first.log_metrics({"train/reward": float(step)}, step)
    first.close()
    # TensorBoard reads a directory's event files in name order: the second's, its creation time, then a per-process
    # counter compared as text ('10' before '9' after nine writers in this process). A resume in a later second, as a
    # real one is, orders them by time.
    time.sleep(1.05 - time.time() % 1)
    resumed = TensorBoardBackend(tmp_path, purge_step=4)  # resumed after step 3: steps 4 and 5 are redone
    for step in range(4, 7):
        resumed.log_metrics({"train/reward": 10.0 + step}, step)
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/reward")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0), (6, 16.0)]
