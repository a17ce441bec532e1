"""The outer training loop's stops (nemo_like/algorithms/grpo.py ``run_training``) with the steps and saves faked
(no Ray, no model): which step a stop request ends the run after, and which checkpoint it names."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nemo_like.algorithms import grpo
from nemo_like.config import load_config
from nemo_like.utils import run_control as rc
from nemo_like.utils.checkpoint import CheckpointManager
from nemo_like.utils.logger import Logger

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_tiny_cpu.yaml"


class FakeSteps:
    """Steps that only record themselves; saves that make an empty ``step_N`` and may send a signal meanwhile."""

    def __init__(self, signal_during_save_of: int | None) -> None:
        self.events: list[str] = []
        self.signal_during_save_of = signal_during_save_of

    def start(self, *args: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def validate(self, *args: Any) -> dict[str, float]:
        return {}

    def data_ends_after(self) -> bool:
        return False

    def step(self, step: int, timer: Any) -> dict[str, float]:
        self.events.append(f"step {step}")
        return {"train/reward": 0.0, "train/loss": 0.0, "train/nonfinite_steps_skipped": 0.0}

    def save(self, manager: CheckpointManager, step: int, metrics: dict[str, Any]) -> Path:
        self.events.append(f"save {step}")
        if step == self.signal_during_save_of:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice lands while step_N is being written
            time.sleep(0.05)
        path = manager.root / f"step_{step}"
        path.mkdir(parents=True, exist_ok=True)
        return path


def fake_clock(monkeypatch) -> list[float]:
    """A clock the loop and the run control read, moved by the fake steps and saves."""
    clock = [1000.0]
    for name in ("time", "monotonic", "perf_counter"):
        monkeypatch.setattr(time, name, lambda: clock[0])
    return clock


def loop_parts(tmp_path, monkeypatch, *overrides: str) -> SimpleNamespace:
    """The run's parts as ``run_training`` reads them, for the tiny recipe with checkpointing on and ``overrides``
    (the model's FLOP and memory lines, which read its files, left out)."""
    common = [f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ck'}", "checkpointing.enabled=true",
              "logger.progress_bar=false", "logger.plot_at_end=false"]  # fmt: skip
    cfg = load_config(RECIPE, [*common, *overrides])
    for name, value in (("planned_memory_lines", []), ("flops_metrics", {}), ("throughput_metrics", {})):
        monkeypatch.setattr(grpo, name, lambda *a, _v=value, **k: _v)
    monkeypatch.setattr(grpo, "flops_spec", lambda *a, **k: SimpleNamespace(describe=lambda: ""))
    monkeypatch.setattr(grpo, "resolve_model_path", lambda p: p)
    return SimpleNamespace(
        cfg=cfg,
        policy=SimpleNamespace(take_refit_bytes=lambda: 0),
        plan=SimpleNamespace(lines=lambda: [], logprobs=SimpleNamespace(compute_teacher=False)),
        train_loader=SimpleNamespace(batches_in=lambda epochs: epochs * 1000),  # the data outlasts the steps
        val_prompts=[],  # the validation pass's announcement counts them
    )


def run_loop(parts: SimpleNamespace, runner: FakeSteps, control: rc.RunControl | None) -> list[dict[str, Any]]:
    """``run_training`` on ``parts`` with ``runner``'s steps, under ``control`` (None: none active)."""
    rc.activate(control)
    logger = Logger(parts.cfg.logger, parts.cfg.grpo.max_num_steps, None)
    try:
        return grpo.run_training(parts, logger, None, runner)  # type: ignore[arg-type]
    finally:
        rc.activate(None)
        logger.close()


def test_a_signal_during_a_periodic_save_stops_right_after_that_save(tmp_path, monkeypatch):
    """The stop used to be sampled only before the save: one more step and one more save ran first."""
    overrides = [
        "checkpointing.save_period=2",
        "grpo.max_num_steps=6",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "grpo.val_at_end=false",
    ]
    parts = loop_parts(tmp_path, monkeypatch, *overrides)
    runner = FakeSteps(signal_during_save_of=2)
    control = rc.RunControl()
    control.install_signal_handlers()
    try:
        with pytest.raises(rc.RunInterrupted) as stopped:
            run_loop(parts, runner, control)
    finally:
        control.restore_signal_handlers()
    assert runner.events == ["step 1", "step 2", "save 2"]
    assert stopped.value.code == rc.EXIT_SIGTERM and stopped.value.step == 2
    assert Path(stopped.value.checkpoint).name == "step_2"


class ClockedSteps(FakeSteps):
    """Steps, saves and (when ``validate_s``) validations of fixed lengths on a fake clock."""

    def __init__(self, clock: list[float], step_s: float, save_s: float, validate_s: float | None = None) -> None:
        super().__init__(signal_during_save_of=None)
        self.clock, self.step_s, self.save_s, self.validate_s = clock, step_s, save_s, validate_s

    def validate(self, step: int, timer: Any) -> dict[str, float]:
        if self.validate_s is None:
            return super().validate(step, timer)
        self.events.append(f"validate {step}")
        self.clock[0] += self.validate_s
        return {"validation/accuracy": 0.0}

    def step(self, step: int, timer: Any) -> dict[str, float]:
        self.clock[0] += self.step_s
        return super().step(step, timer)

    def save(self, manager: CheckpointManager, step: int, metrics: dict[str, Any]) -> Path:
        self.clock[0] += self.save_s
        return super().save(manager, step, metrics)


def test_the_step_before_a_validation_keeps_the_validation_in_hand_before_the_deadline(tmp_path, monkeypatch):
    """10 s steps, a 600 s validation every 10 steps, 100 s of slack: the run started step 10 and its validation and
    ended ~500 s past its deadline; the loop must ask stop_reason with the next step's validation in hand."""
    clock = fake_clock(monkeypatch)
    parts = loop_parts(
        tmp_path, monkeypatch, "checkpointing.save_period=100", "grpo.max_num_steps=20", "grpo.val_period=10", "grpo.val_at_end=false"
    )
    runner = ClockedSteps(clock, step_s=10.0, save_s=5.0, validate_s=600.0)  # a 600 s validation every 10 steps
    deadline = clock[0] + 600.0 + 9 * 10.0 + 2 * 5.0 + 100.0  # step 0's validation, 9 steps, 2 saves, the slack
    with pytest.raises(rc.RunInterrupted) as stopped:
        run_loop(parts, runner, rc.RunControl(deadline))
    assert stopped.value.code == rc.EXIT_DEADLINE and stopped.value.step == 9, runner.events
    assert "validate 10" not in runner.events and clock[0] <= deadline


@pytest.mark.parametrize("slack", [1371.0, 1400.0, 1500.0])
def test_a_step_that_saves_keeps_its_own_save_in_hand_before_the_deadline(tmp_path, monkeypatch, slack: float):
    """checkpointing.save_period=1, saves slower than steps: the stop was decided before the step's own save, which
    went uncounted, so going on cost that save, a step and the stop's save while only a step and a save were kept:
    the stop checkpoint ended up to 69 s past the deadline (a Slurm job killed while writing it)."""
    clock = fake_clock(monkeypatch)
    overrides = ["checkpointing.save_period=1", "checkpointing.keep_top_k=null", "grpo.max_num_steps=1000", "grpo.val_at_start=false",
                 "grpo.val_period=0", "grpo.val_at_end=false"]  # fmt: skip
    parts = loop_parts(tmp_path, monkeypatch, *overrides)
    runner = ClockedSteps(clock, step_s=60.0, save_s=120.0)  # saves slower than steps
    deadline = clock[0] + slack
    with pytest.raises(rc.RunInterrupted) as stopped:
        run_loop(parts, runner, rc.RunControl(deadline))
    assert stopped.value.code == rc.EXIT_DEADLINE and "this step's save, a step and a save need" in stopped.value.reason.what
    assert clock[0] <= deadline, f"the stop checkpoint ended {clock[0] - deadline:.0f}s past the deadline"
    assert runner.events[-1] == f"save {stopped.value.step}" and runner.events.count(f"save {stopped.value.step}") == 1


class EpochSteps(FakeSteps):
    """Steps that run out of data after ``steps`` steps (grpo.max_num_epochs), saves that record their metrics;
    ``knows_the_end``: the runner says so after the last step (the sync loop's), else only at the next (async's)."""

    def __init__(self, steps: int, knows_the_end: bool = False) -> None:
        super().__init__(signal_during_save_of=None)
        self.steps, self.knows_the_end, self.ran = steps, knows_the_end, 0
        self.saved: dict[int, dict[str, Any]] = {}

    def data_ends_after(self) -> bool:
        return self.knows_the_end and self.ran >= self.steps

    def validate(self, step: int, timer: Any) -> dict[str, float]:
        self.events.append(f"validate {step}")
        return {"validation/accuracy": 0.5}

    def step(self, step: int, timer: Any) -> dict[str, float]:
        if step > self.steps:
            raise grpo.DataExhausted("grpo.max_num_epochs=1 reached")
        self.ran = step
        return super().step(step, timer)

    def save(self, manager: CheckpointManager, step: int, metrics: dict[str, Any]) -> Path:
        self.saved[step] = dict(metrics)
        return super().save(manager, step, metrics)


def test_the_last_checkpoint_of_a_run_that_ran_out_of_data_holds_its_end_of_run_validation(tmp_path, monkeypatch):
    """grpo.max_num_epochs ended the run after a step already saved (save_period=1): its val_at_end validation was
    logged but never reached the checkpoint, which best-k retention and a resume read."""
    overrides = [
        "checkpointing.save_period=1",
        "grpo.max_num_steps=5",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "grpo.val_at_end=true",
    ]
    runner = EpochSteps(2)  # async: the end is found at the next step's take
    run_loop(loop_parts(tmp_path, monkeypatch, *overrides), runner, None)
    assert runner.events == ["step 1", "save 1", "step 2", "save 2", "validate 2", "save 2"]
    assert runner.saved[2]["validation/accuracy"] == 0.5
    knowing = EpochSteps(2, knows_the_end=True)  # sync: the last step validates inside its record and saves once
    run_loop(loop_parts(tmp_path / "sync", monkeypatch, *overrides), knowing, None)
    assert knowing.events == ["step 1", "save 1", "step 2", "validate 2", "save 2"]
    assert knowing.saved[2]["validation/accuracy"] == 0.5
