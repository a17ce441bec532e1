"""The console line's ETA: the recent steps' durations times the steps left, never the start-up."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nemo_like.utils.logger import ETA_WINDOW, ConsoleProgress, eta_seconds, format_eta, format_seconds

REPO = Path(__file__).resolve().parents[3]


class SteppedClock:
    """A clock the test advances by hand (no wall time is read or waited for)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_no_step_duration_means_no_eta() -> None:
    assert eta_seconds([], remaining=99) is None
    assert format_eta(None) == "eta ?"


def test_eta_is_the_recent_mean_step_time_times_the_steps_left() -> None:
    assert eta_seconds([0.3], remaining=98) == pytest.approx(29.4)
    assert eta_seconds([0.2, 0.4, 0.3], remaining=10) == pytest.approx(3.0)
    assert eta_seconds([0.5], remaining=0) == 0.0


def test_only_the_last_window_steps_count() -> None:
    slow_then_fast = [10.0] * 20 + [1.0] * ETA_WINDOW  # the run sped up (e.g. a compile or cache warm-up at first)
    assert eta_seconds(slow_then_fast, remaining=5) == pytest.approx(5.0)
    assert eta_seconds([9.0, 1.0, 1.0, 1.0], remaining=6, window=3) == pytest.approx(6.0)


def test_a_long_start_up_does_not_inflate_the_eta(capsys) -> None:
    """A 20 s start-up, then 0.3 s steps: the ETA is remaining x 0.3 s, not remaining x ~20 s (the old
    elapsed/step rule printed `eta 2009s` at step 1 of such a run)."""
    clock = SteppedClock()
    progress = ConsoleProgress(100, enabled=True, clock=clock)
    clock.now += 20.0  # actors start, models load, the step-0 validation runs
    for step in range(1, 11):
        clock.now += 0.3
        progress.update(step, f"reward={step}")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 10
    assert lines[0] == "[step 1/100] reward=1 | elapsed 20s eta ?"  # no step has a measured duration yet
    assert lines[1] == "[step 2/100] reward=2 | elapsed 21s eta 29s"  # 98 x 0.3 s = 29.4 s
    assert lines[9] == "[step 10/100] reward=10 | elapsed 23s eta 27s"  # 90 x 0.3 s
    assert list(progress.step_seconds) == pytest.approx([0.3] * ETA_WINDOW)


def test_a_resumed_run_measures_from_its_first_update(capsys) -> None:
    clock = SteppedClock()
    progress = ConsoleProgress(50, enabled=True, clock=clock)
    clock.now += 30.0
    progress.update(41, "r")  # resumed at step 40: the jump from 0 to 41 is no step duration
    clock.now += 2.0
    progress.update(42, "r")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("eta ?")
    assert lines[1].endswith("eta 16s")  # 8 x 2 s


def test_a_restarted_attempts_display_counts_elapsed_from_the_runs_start(capsys) -> None:
    """An in-process restart builds a new logger 600 s into the run: its first line said `elapsed 50s`, not 10m50s
    (logging.md: elapsed counts from the start of the run)."""
    clock = SteppedClock()
    progress = ConsoleProgress(10, enabled=True, clock=clock, elapsed_s=600.0)
    clock.now += 50.0
    progress.update(5, "r")
    assert capsys.readouterr().err.splitlines() == ["[step 5/10] r | elapsed 10m50s eta ?"]


def test_durations_read_like_a_clock() -> None:
    assert format_seconds(42.4) == "42s"
    assert format_seconds(725) == "12m05s"
    assert format_seconds(3 * 3600 + 2 * 60 + 7) == "3h02m"
    assert format_eta(29.4) == "eta 29s"


def test_on_a_terminal_the_bar_and_messages_go_to_stderr_as_plain_text(tmp_path) -> None:
    """Under a real terminal (a pty on stderr): the bar was drawn on stdout (``train > run.log`` showed no progress on
    the terminal), and messages were read as rich markup: "[setup] ..." lost its prefix and "[/tmp]" raised."""
    import os
    import pty
    import subprocess
    import sys

    child = (
        "from nemo_like.utils.logger import ConsoleProgress\n"
        "p = ConsoleProgress(3)\n"
        "p.message('[setup] logging to logs/sweep[lr=1e-5]/metrics.jsonl')\n"
        "print('a set-up line on stdout', flush=True)\n"
        "assert p._rich is None\n"  # no bar before the first step
        "p.message('[checkpoint] saved results/[/tmp]/step_3')\n"
        "p.update(1, 'reward=[0.5]')\n"
        "assert p._rich is not None\n"
        "print('to stdout', flush=True)\n"
        "with p.during('[step 1] validating: 3 prompts x 2 responses'):\n"
        "    pass\n"
        "p.update(2, 'reward=[0.6]')\n"
        "with p.during('[step 2] validating: 3 prompts x 2 responses'):\n"  # the end-of-run one: no update after it
        "    pass\n"
        "p.close()\n"
    )

    def run(stdout_on_the_terminal: bool) -> tuple[subprocess.CompletedProcess, str]:
        master, slave = pty.openpty()
        stdout = slave if stdout_on_the_terminal else subprocess.PIPE
        proc = subprocess.run([sys.executable, "-c", child], stderr=slave, stdout=stdout, timeout=60, cwd=REPO)
        os.close(slave)
        terminal = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child's end is closed and everything was read
                break
            if not chunk:
                break
            terminal += chunk
        os.close(master)
        return proc, terminal.decode(errors="replace")

    proc, text = run(stdout_on_the_terminal=False)
    assert proc.returncode == 0 and proc.stdout == b"a set-up line on stdout\nto stdout\n"  # where the user sent it
    assert "[setup] logging to logs/sweep[lr=1e-5]/metrics.jsonl" in text and "[checkpoint] saved results/[/tmp]/step_3" in text
    # stdout on the same terminal (Ray's actors print there): each line above the bar, none glued after its text
    proc, text = run(stdout_on_the_terminal=True)
    assert proc.returncode == 0 and "GRPO" in text
    assert text.index("a set-up line on stdout") < text.index("GRPO")  # the bar waits for the first step
    assert re.search(r"eta [^\r\n]*to stdout", text) is None, repr(text)  # was "... eta ?to stdout"
    # a validation pass between two steps shows in the bar's text, not as a line that would scroll the bar away
    assert re.search(r"GRPO[^\r\n]*\[step 1\] validating: 3 prompts x 2 responses", text), repr(text)
    last_bar = text.rsplit("GRPO", 1)[1]  # as the run leaves it: the last step's text, not "validating" (was)
    assert "reward=[0.6]" in last_bar and "validating" not in last_bar, repr(last_bar)


def test_without_a_bar_a_validation_pass_is_announced_by_a_line(capsys) -> None:
    progress = ConsoleProgress(10, enabled=True, clock=SteppedClock())
    with progress.during("[step 0] validating: 500 prompts x 4 responses"):  # before the first step: no bar yet
        pass
    progress.update(1, "r")
    with progress.during("[step 1] validating: 500 prompts x 4 responses"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == lines[2].replace("step 1", "step 0") == "[step 0] validating: 500 prompts x 4 responses"
    with ConsoleProgress(10, enabled=False).during("[step 0] validating: 1 prompts x 1 responses"):  # logger.progress_bar=false
        pass
    assert capsys.readouterr().err == ""


def test_a_run_that_its_epochs_end_first_counts_to_its_last_step(capsys) -> None:
    """grpo.max_num_epochs ending a run at step 4 of max_num_steps=100: the lines said 4/100 and an ETA for 96 steps
    that never ran (run_training sets the total from the loader: PromptDataLoader.batches_in)."""
    clock = SteppedClock()
    progress = ConsoleProgress(100, enabled=True, clock=clock)
    progress.set_total(4)
    for step in (1, 2, 3):
        clock.now += 5.0
        progress.update(step, "r")
    assert capsys.readouterr().err.splitlines()[1:] == ["[step 2/4] r | elapsed 10s eta 10s", "[step 3/4] r | elapsed 15s eta 5s"]


def test_validations_ahead_count_apart_from_the_steps(capsys) -> None:
    """10 s steps, a 60 s validation every 20 steps, 100 steps (the reviewer's case): at step 19 the ETA was 13m30s for
    18m30s left, and 23m20s for 17m20s just after step 20's validation (it swung by a third around each)."""
    from nemo_like.algorithms.grpo import validations_after
    from nemo_like.config import load_config

    cfg = load_config(None, ["grpo.val_period=20", "grpo.val_at_end=true"])
    clock = SteppedClock()
    progress = ConsoleProgress(100, enabled=True, clock=clock)
    lines = {}
    for step in range(1, 41):
        validation = 60.0 if step % 20 == 0 else 0.0
        clock.now += 10.0 + validation
        progress.update(step, "r", validation, validations_after(cfg, step, 100))
        lines[step] = capsys.readouterr().err.strip()
    assert lines[19].endswith("eta 13m30s")  # no validation measured yet: 81 x 10 s
    assert lines[20].endswith("eta 17m20s")  # 80 x 10 s + 4 validations x 60 s: the time left
    assert lines[39].endswith("eta 14m10s") and lines[40].endswith("eta 13m00s")  # 61 x 10 + 4 x 60; 60 x 10 + 3 x 60
    assert [validations_after(cfg, s, 100) for s in (0, 19, 20, 99, 100)] == [5, 5, 4, 1, 0]
    assert validations_after(cfg, 90, 95) == 1 and validations_after(cfg, 95, 95) == 0  # the last step's, off the period
    never = load_config(None, ["grpo.val_period=0", "grpo.val_at_end=false"])
    assert validations_after(never, 0, 100) == 0
