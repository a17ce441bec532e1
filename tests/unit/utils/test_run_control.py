"""Stop requests (real signals to this process), the deadline's forms and when the run decides to stop."""

from __future__ import annotations

import io
import os
import re
import signal
import time
from pathlib import Path

import pytest

from nemo_like.config import ConfigError, load_config
from nemo_like.utils.deadline import resolve_deadline, resolve_run_deadline
from nemo_like.utils.run_control import EXIT_DEADLINE, EXIT_SIGINT, EXIT_SIGTERM, STOP_SECONDS, RunControl, RunInterrupted, StopReason


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, EXIT_SIGTERM), (signal.SIGINT, EXIT_SIGINT)])
def test_a_first_signal_requests_a_stop_with_its_status(signum, status, capsys):
    control = RunControl()
    before = signal.getsignal(signum)
    control.install_signal_handlers()
    try:
        control.step_started(7)
        assert control.stop_reason() is None
        os.kill(os.getpid(), signum)  # handled in this (main) thread at the next bytecode
        time.sleep(0.01)
        reason = control.stop_reason()
        assert reason is not None and reason.status == status and reason.what == signal.Signals(signum).name
    finally:
        control.restore_signal_handlers()
    assert signal.getsignal(signum) is before
    assert "received during step 7: finishing it, saving a checkpoint" in capsys.readouterr().err

    def first_line(control: RunControl) -> str:
        control.install_signal_handlers()
        try:
            os.kill(os.getpid(), signum)
            time.sleep(0.01)
        finally:
            control.restore_signal_handlers()
        return capsys.readouterr().err

    quiet = RunControl(saves=False)  # checkpointing off: the first line said it was saving one
    quiet.step_started(3)
    assert "finishing it, no checkpoint to save (checkpointing.enabled=false)" in first_line(quiet)
    # set-up or step 0's validation: it said "finishing step 0, saving", then ran step 1
    assert "received before the first step: stopping there, nothing to save, then exiting" in first_line(RunControl())
    restart = RunControl()  # a restart's set-up after a death in step 5: it said "finishing step 5, saving" (no step came)
    restart.step_started(5)
    restart.attempt_started()
    assert "received before a step began: stopping there, nothing new to save, then exiting" in first_line(restart)
    # The stop's output watchers block the stop signals: a second one must reach the main thread (it exits at once)
    watchers = [t for t in __import__("threading").enumerate() if t.name.startswith("stop-output-watch-")]
    assert watchers
    for thread in watchers:
        status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
        blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
        assert blocked & (1 << (signal.SIGINT - 1)) and blocked & (1 << (signal.SIGTERM - 1)), thread.name


def test_a_stopped_run_gives_the_process_its_streams_back_and_watches_once(capsys):
    """train() called twice from one script, each stopped: the caller kept the stop's wrapped sys.stdout/sys.stderr
    after train() returned, and two more watcher threads piled up with each stop."""
    import sys
    import threading

    def watchers() -> int:
        return sum(t.name.startswith("stop-output-watch-") for t in threading.enumerate())

    for _ in range(2):
        streams = (sys.stdout, sys.stderr)
        control = RunControl()
        control.install_signal_handlers()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            assert control.stop_reason() is not None and sys.stdout is not streams[0]  # wrapped while it stops
        finally:
            control.restore_signal_handlers()
        assert (sys.stdout, sys.stderr) == streams
        assert watchers() == 2
    # a stream replaced after the stop (a progress bar restoring the one it had replaced) is left as it is: putting back
    # the stream of the moment of the stop left a terminal's sys.stderr the bar's dead proxy
    control = RunControl()
    control.install_signal_handlers()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        restored_by_the_bar = sys.stderr = io.StringIO()
    finally:
        control.restore_signal_handlers()
        stderr_now, sys.stderr = sys.stderr, streams[1]
    assert stderr_now is restored_by_the_bar and sys.stdout is streams[0]


def test_run_interrupted_exits_with_the_reasons_status():
    stop = RunInterrupted(StopReason("SIGTERM", 143), 3, "/ck/step_3")
    assert isinstance(stop, SystemExit) and stop.code == 143 and stop.step == 3


def test_the_deadline_keeps_the_slowest_step_and_save_in_hand():
    control = RunControl(deadline=time.time() + 100)
    assert control.wants_save()  # a save is measured as soon as possible
    control._steps.extend([1.0, 30.0, 2.0])
    assert control.stop_reason() is None  # no save yet: the slowest step stands for it: 1.25 * (30 + 30) + 15 = 90 < 100
    control._saves.append(70.0)
    assert not control.wants_save() and not RunControl().wants_save()
    assert control.seconds_needed() == pytest.approx(1.25 * (30 + 70) + STOP_SECONDS)
    reason = control.stop_reason()
    assert reason is not None and reason.status == EXIT_DEADLINE and "checkpointing.save_before" in reason.what


def test_a_death_near_the_deadline_counts_the_restarts_start_of_the_actors():
    """A policy worker killed 11 s before save_before restarted (13 s to start the actors again) and the run exited
    10 s past the deadline."""
    control = RunControl(deadline=time.time() + 60)
    control._steps.append(10.0)
    control._saves.append(5.0)
    control.setup_finished(30.0)
    assert control.seconds_needed() == pytest.approx(1.25 * 15 + STOP_SECONDS)  # 33.75: going on is fine ...
    assert control.stop_reason() is None
    assert control.seconds_needed(restarting=True) == pytest.approx(1.25 * 45 + STOP_SECONDS)  # ... a restart is not
    reason = control.stop_reason(restarting=True)
    assert reason is not None and reason.status == EXIT_DEADLINE and "a restart's start of the actors" in reason.what


def test_the_step_before_a_validation_keeps_the_validation_in_hand(monkeypatch):
    """10 s steps, a 600 s validation every 10 steps, 5 s saves: the last three steps never held a validation, so the
    run started step 10 with 100 s left and ended it 505 s past the deadline (killed before its stop checkpoint). The
    loop's own order: step_started, the step and its validation, step_finished, stop_reason, save."""
    import nemo_like.utils.run_control as run_control

    clock = [1_000_000.0]
    monkeypatch.setattr(run_control.time, "time", lambda: clock[0])
    monkeypatch.setattr(run_control.time, "monotonic", lambda: clock[0])
    deadline = clock[0] + 9 * 10.0 + 2 * 5.0 + 100.0
    control = RunControl(deadline)
    control.validation_finished(600.0)  # step 0's validation (grpo.val_at_start)
    for step in range(1, 21):
        control.step_started(step)
        validation = 600.0 if step % 10 == 0 else 0.0
        clock[0] += 10.0 + validation
        control.step_finished(validation)
        assert clock[0] <= deadline, f"step {step} ended {clock[0] - deadline:.0f}s after the deadline"
        stop = control.stop_reason(validates_next=(step + 1) % 10 == 0)
        if step == 1 or stop is not None:
            clock[0] += 5.0
            control.save_finished()
        if stop is not None:
            break
    assert stop is not None and step == 9 and "a step, its validation and a save need" in stop.what
    assert control.seconds_needed() == pytest.approx(1.25 * (10 + 5) + STOP_SECONDS)  # a step without validation: the step alone


def test_deadline_forms():
    assert resolve_deadline(None, 50.0) == (None, "no deadline")
    assert resolve_deadline("90", 50.0)[0] == 140.0
    assert resolve_deadline("auto", 0.0, {"SLURM_JOB_END_TIME": "1234567"})[0] == 1234567.0
    assert resolve_deadline("auto", 0.0, {})[0] is None  # no scheduler: no deadline
    iso = resolve_deadline("2030-01-02T03:04:05+00:00", 0.0)[0]
    assert iso == 1893553445.0


def test_bad_save_before_names_the_key():
    with pytest.raises(ConfigError, match="checkpointing.save_before must be 'auto'"):
        load_config(None, ["checkpointing.enabled=true", "checkpointing.save_before=tomorrow"])
    with pytest.raises(ConfigError, match="checkpointing.save_before needs checkpointing.enabled=true"):
        load_config(None, ["checkpointing.save_before=60"])
    for value in ("nan", "inf", "1e+30", "-100", "0"):  # nan never stopped a run; inf and 1e30 crashed it; -100 stopped at once
        with pytest.raises(ConfigError, match=rf"checkpointing.save_before: '{re.escape(value)}' seconds from the start is not a time"):
            load_config(None, ["checkpointing.enabled=true", f"checkpointing.save_before={value}"])
    for value in ("nan", "1e400", "garbage", "-5"):  # a traceback (or no deadline at all) before
        with pytest.raises(ConfigError, match=rf"\$SLURM_JOB_END_TIME='{value}' is not Unix seconds"):
            resolve_deadline("auto", 0.0, {"SLURM_JOB_END_TIME": value})


def test_save_before_auto_with_a_slurm_deadline_and_checkpointing_off_is_refused_before_setup(tmp_path, monkeypatch):
    """It was accepted: the run stopped with 75 having saved nothing, and a requeued job restarted from step 0 forever."""
    from nemo_like import train as train_module

    recipe = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_tiny_cpu.yaml"
    overrides = ["checkpointing.enabled=false", "checkpointing.save_before=auto", f"logger.log_dir={tmp_path / 'logs'}"]
    off = load_config(recipe, [*overrides, f"checkpointing.checkpoint_dir={tmp_path / 'ck'}"])  # harmless as a config
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 3600))
    set_up = []
    monkeypatch.setattr(train_module, "_train_locked", lambda *args: set_up.append(args) or [])
    with pytest.raises(ConfigError, match=r"checkpointing.save_before=auto found a deadline .*checkpointing.enabled=false"):
        train_module.train(off)
    assert not set_up
    slurm = {"SLURM_JOB_END_TIME": str(int(time.time()) + 3600)}
    with pytest.raises(ConfigError, match=r"checkpointing.save_before=auto found a deadline .*checkpointing.enabled=false"):
        resolve_run_deadline(off.checkpointing, time.time(), slurm)
    assert resolve_run_deadline(off.checkpointing, time.time(), {}) == (None, resolve_deadline("auto", 0.0, {})[1])  # no scheduler
    on = load_config(None, ["checkpointing.enabled=true", "checkpointing.save_before=auto"])
    assert resolve_run_deadline(on.checkpointing, time.time(), slurm)[0] == float(slurm["SLURM_JOB_END_TIME"])


def test_a_recipe_names_save_before_as_an_iso_time_unquoted(tmp_path):
    """YAML 1.1 made 2026-12-02T18:00:00 a datetime OmegaConf cannot hold (a traceback), and 18:00:00 the base-60
    number 64800 (18 hours after the start)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("checkpointing:\n  enabled: true\n  save_before: 2030-01-02T03:04:05+00:00\n")
    assert load_config(recipe, []).checkpointing.save_before == "2030-01-02T03:04:05+00:00"
    recipe.write_text("checkpointing:\n  enabled: true\n  save_before: 18:00:00\n")
    with pytest.raises(ConfigError, match=r"checkpointing.save_before must be 'auto'.*got '18:00:00'"):
        load_config(recipe, [])


SECOND_SIGNAL = """
import sys, time
from nemo_like.utils.run_control import RunControl
control = RunControl()
control.install_signal_handlers()
control.step_started(3)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def test_a_second_signal_exits_at_once_with_the_first_ones_status():
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", SECOND_SIGNAL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)  # the first: a stop request; the process keeps running (the step would finish)
        time.sleep(0.3)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)  # the second: exit now
        status = proc.wait(timeout=10)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert status == EXIT_SIGINT and "SIGINT received during step 3" in err and "second SIGINT: exiting now" in err, err


AFTER_THE_RUN = """
import sys, time
from nemo_like.utils.run_control import RunControl
control = RunControl()
control.install_signal_handlers()
control.step_started(2)
control.step_finished()
control.run_finished()
print("ready", flush=True)  # the run's summary line; its plot is being written
time.sleep(float(sys.argv[1]))
print("plot written", flush=True)
"""


@pytest.mark.parametrize("signals", [1, 2])
def test_a_signal_after_the_run_finished_leaves_its_status_0(signals):
    """Ctrl-C after the run's [done] line, while its plot was written: 'during step 2: finishing it, saving a
    checkpoint', then exit 130 and no plot. Now the plot is written and the status is 0; a second signal leaves at once."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", AFTER_THE_RUN, "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(signals):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
        status = proc.wait(timeout=10)
    finally:
        proc.kill()
    out, err = proc.stdout.read(), proc.stderr.read()
    assert status == 0 and "received after the run finished: exiting with status 0 once its plot is written" in err, err
    assert ("plot written" in out) is (signals == 1) and ("second SIGINT after the run finished: leaving now" in err) is (signals == 2)
    assert "step 2" not in err


EXITING = """
import atexit, sys, time
atexit.register(lambda: (print("teardown", flush=True), time.sleep(20)))  # as Ray's exit hook shuts a private cluster down
ending = sys.argv[1]
sys.argv = ["nemo-like", "plot", ending]  # a command that ends at once (status 2: no metrics there)
import nemo_like.cli
if ending.endswith("crash"):  # a command that crashes (an environment's error, say): its traceback, status 1
    def crash():
        raise RuntimeError("the environment raised")
    nemo_like.cli.main = crash
nemo_like.cli.console_main()
"""


@pytest.mark.parametrize("ending", ["nowhere", "crash"])
def test_a_signal_while_the_command_exits_leaves_at_once_with_its_status(tmp_path, ending):
    """A second Ctrl-C after a stopped run's last line landed in Ray's exit hook (the private cluster's shutdown, 4-8 s):
    a KeyboardInterrupt traceback after the run's output, or a crash in Ray's native code (status -11, not 130). After
    a crash too: a SIGTERM there made the status 143, a clean stop's to a requeue rule."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", EXITING, str(tmp_path / ending)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "teardown"
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=10)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert "[stop] SIGINT while exiting: leaving now" in err and "KeyboardInterrupt" not in err, err
    if ending == "crash":
        assert status == 1 and err.count("Traceback") == 1 and "RuntimeError: the environment raised" in err, err
    else:
        assert status == 2 and "Traceback" not in err, err
    assert "Ray cluster" not in err  # plot starts none: its shutdown was said to be cut short


TEED = """
import sys, time
from pathlib import Path
from nemo_like.utils.run_control import RunControl
control = RunControl()
control.install_signal_handlers()
print("ready", flush=True)
for step in range(1, 1000):
    control.step_started(step)
    print(f"step {step}", flush=True)  # the run's progress lines, into the pipe whose reader is gone after the signal
    time.sleep(0.05)
    control.step_finished()
    if (reason := control.stop_reason()) is not None:
        Path(sys.argv[1]).write_text(f"saved after step {step}")  # the stop's checkpoint
        print(f"[stop] saved; exiting {reason.status}", flush=True)
        sys.exit(reason.status)
"""


def test_ctrl_c_on_a_run_piped_into_tee_still_finishes_the_step_saves_and_exits_130(tmp_path):
    """Ctrl-C ends `tee` too: the handler's print to the closed pipe raised BrokenPipeError into the step (exit 1, no
    save); the run's next progress line would have raised it as well."""
    import subprocess
    import sys

    for tee_exits_after_the_handler in (False, True):  # the same Ctrl-C reaches both: either may run first
        saved = tmp_path / f"saved-{tee_exits_after_the_handler}"
        read, write = os.pipe()  # `2>&1 | tee`: stdout and stderr are one pipe
        proc = subprocess.Popen([sys.executable, "-c", TEED, str(saved)], stdout=write, stderr=write)
        os.close(write)
        try:
            reader = os.fdopen(read, "rb", buffering=0)
            assert reader.readline().strip() == b"ready"
            if tee_exits_after_the_handler:
                proc.send_signal(signal.SIGINT)
                while b"SIGINT received" not in reader.readline():  # the handler has run (its line is out), then tee exits
                    pass
                reader.close()
            else:  # the run is held while tee exits and the Ctrl-C arrives: it then meets both at once, as under a
                # real Ctrl-C (closing the reader first let a progress line break the pipe before any signal was sent:
                # the run was ending on that BrokenPipeError when the SIGINT came, status -2)
                proc.send_signal(signal.SIGSTOP)
                reader.close()
                proc.send_signal(signal.SIGINT)
                proc.send_signal(signal.SIGCONT)
            status = proc.wait(timeout=30)
        finally:
            proc.kill()
        assert status == EXIT_SIGINT and saved.read_text().startswith("saved after step"), tee_exits_after_the_handler


SLOW_SETUP = """
import signal, sys, time
from pathlib import Path
from nemo_like import train
from nemo_like.config import load_config
from nemo_like.utils.logger import Logger
from nemo_like.utils.run_control import STOP_SIGNALS, RunControl, activate
cfg = load_config(Path(sys.argv[2]), [f"logger.log_dir={sys.argv[1]}", "logger.progress_bar=false", "logger.plot_at_end=false"])
control = RunControl()
activate(control)
control.install_signal_handlers()

def slow_setup(cfg, ray_started=None, data=None):
    print(f"ray starting; signals held: {STOP_SIGNALS <= signal.pthread_sigmask(signal.SIG_BLOCK, [])}", flush=True)
    if ray_started is not None:
        ray_started()
    print("models loading", flush=True)
    time.sleep(30)  # loading models, starting actors: minutes on a cluster, forever under a hung constructor
    sys.exit(3)

train.setup_grpo = slow_setup
train._train_attempt(cfg, time.perf_counter(), control, None, Logger(cfg.logger, cfg.grpo.max_num_steps, None), [])
"""


def test_a_second_signal_exits_at_once_while_models_load_and_ray_starts_with_them_held(tmp_path):
    """The whole of setup ran with SIGTERM and SIGINT blocked: two Ctrl-C's there merged into one pending stop request,
    and a slow or hung setup could not be interrupted but by SIGKILL."""
    import subprocess
    import sys

    recipe = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_tiny_cpu.yaml"
    args = [sys.executable, "-c", SLOW_SETUP, str(tmp_path / "logs"), str(recipe)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = iter(proc.stdout.readline, "")
        first = next(line for line in lines if not line.startswith("data."))  # the prompts load first, unmasked
        assert first.strip() == "ray starting; signals held: True"  # Ray's processes inherit the mask
        assert proc.stdout.readline().strip() == "models loading"
        proc.send_signal(signal.SIGINT)  # the first: a stop request (after the first step)
        time.sleep(0.3)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)  # the second: exit now, setup or not
        status = proc.wait(timeout=10)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert status == EXIT_SIGINT and "second SIGINT: exiting now" in err, err


def _blocked_signals(native_id: int) -> set[int]:
    """The signals blocked in a thread of this process (Linux: /proc/self/task/<tid>/status, SigBlk)."""
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
    return {number for number in range(1, 65) if mask >> (number - 1) & 1}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread signal masks from /proc (Linux)")
def test_a_loggers_threads_never_take_the_runs_stop_signals(tmp_path):
    """TensorBoard's writer thread started unblocked: a SIGTERM during ray.init then landed in it, under Ray's handler,
    which aborts the driver (134) instead of the deferred stop (143)."""
    import threading

    from nemo_like.config.schema import LoggerConfig
    from nemo_like.utils.logger import Logger

    main_before = _blocked_signals(threading.get_native_id())
    before = set(threading.enumerate())
    logger = Logger(LoggerConfig(log_dir=str(tmp_path), tensorboard_enabled=True, progress_bar=False), 3)
    try:
        started = [t for t in threading.enumerate() if t not in before and t.native_id is not None]
        assert started  # TensorBoard's writer
        for thread in started:
            assert {signal.SIGTERM, signal.SIGINT} <= _blocked_signals(thread.native_id), thread.name
        assert _blocked_signals(threading.get_native_id()) == main_before  # the main thread's mask is as it was
    finally:
        logger.close()


def test_after_a_stop_a_write_to_an_output_whose_reader_left_is_dropped_not_raised():
    """The watcher thread silences a departed reader's fd, but a tight loop of writes could beat it to the GIL: the
    write raised BrokenPipeError (1 in 10 runs). sys.stdout and sys.stderr are wrapped from the stop on."""
    import io

    from nemo_like.utils.run_control import _QuietOnBrokenPipe

    read, write = os.pipe()
    stream = io.TextIOWrapper(io.BufferedWriter(io.FileIO(write, "w")), line_buffering=True)
    os.close(read)  # tee left
    with pytest.raises(BrokenPipeError):
        stream.write("step 7\n")
    quiet = _QuietOnBrokenPipe.wrap(stream)
    assert quiet.write("step 7\n") == 7 and quiet.flush() is None  # dropped; the fd now goes to /dev/null
    assert os.path.realpath(f"/proc/self/fd/{write}") == os.devnull and quiet.fileno() == write
    assert _QuietOnBrokenPipe.wrap(quiet) is quiet
    stream.close()


def test_a_stop_whose_exception_was_swallowed_or_lost_its_type_is_still_the_signals(tmp_path) -> None:
    """A SIGTERM whose exception C code swallowed (torch's import of numpy catches it) let the command go on: a whole
    training ran and exited 0; ray.get re-raises the exception as a plain KeyboardInterrupt, so a SIGTERM during an eval's
    sampling was reported as a Ctrl-C (130). The real handler, a real signal to this process."""
    from nemo_like.train import train
    from nemo_like.utils.stop_signals import CommandStopped, command_stop, raise_if_stopped, stop_signals_raise, stop_signals_restored

    previous = stop_signals_raise()
    try:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except CommandStopped:
            pass  # swallowed, as C code that catches it does
        assert command_stop(KeyboardInterrupt()).status == EXIT_SIGTERM  # a plain one stands for the signal raised
        with pytest.raises(CommandStopped) as stopped:
            raise_if_stopped()
        assert stopped.value.signal == signal.SIGTERM
        cfg = load_config(None, [f"logger.log_dir={tmp_path / 'logs'}", "grpo.max_num_steps=1"])
        with pytest.raises(CommandStopped):  # before the run: no lock, no record, no cluster
            train(cfg)
        assert not (tmp_path / "logs" / "metrics.jsonl").exists() and not (tmp_path / "logs" / ".nemo_like.lock").exists()
    finally:
        stop_signals_restored(previous)
    raise_if_stopped()  # forgotten: an in-process caller's next command starts clean
    assert command_stop(KeyboardInterrupt()).status == EXIT_SIGINT and signal.getsignal(signal.SIGTERM) == previous[signal.SIGTERM]


def test_ray_inits_exit_on_sigterm_is_the_commands_stop_and_a_decided_status_is_written_whole(tmp_path, monkeypatch) -> None:
    """Ray's Python handler during ray.init calls sys.exit(15): eval exited 15 with no line. A SIGTERM while the CLI wrote
    the exit status file (its handlers already the caller's: the default action) killed it mid-write: no status."""
    from nemo_like.utils import files
    from nemo_like.utils.stop_signals import CommandStopped, signals_ignored, stop_signals_kept

    with pytest.raises(CommandStopped) as stopped:
        with stop_signals_kept():
            raise SystemExit(signal.SIGTERM)
    assert stopped.value.status == EXIT_SIGTERM
    with pytest.raises(SystemExit, match="2"), stop_signals_kept():
        raise SystemExit(2)  # any other exit is left alone
    before = signal.getsignal(signal.SIGTERM)
    with signals_ignored():
        os.kill(os.getpid(), signal.SIGTERM)  # ignored: this process goes on
        time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) == before
    # A stop handled as replace_file's open returned left the new empty partial file behind
    real_open = os.open

    def opened_then_stopped(*args, **kwargs):
        real_open(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "open", opened_then_stopped)
    with pytest.raises(KeyboardInterrupt):
        files.replace_file(tmp_path / "status", "0\n")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_a_stop_while_the_prompts_load_ends_the_run_before_ray_starts(tmp_path):
    """Loading the prompts runs outside the held signals (a large set's loading is no stall): a Ctrl-C there let the
    run start Ray and its actors and train a whole step before it stopped."""
    import json
    import subprocess
    import sys

    from nemo_like.data.prompts import LARGE_SET

    data = tmp_path / "large.jsonl"
    data.write_text("".join(json.dumps({"q": f"What is {i} plus {i + 1}?", "a": str(2 * i + 1)}) + "\n" for i in range(LARGE_SET * 2)))
    overrides = [f"data.train.data_path={data}", "data.dataset_name=null", "data.prompt_key=q", "data.answer_key=a"]
    overrides += ["data.train.num_problems=null", "data.validation.split_fraction=0.01", f"logger.log_dir={tmp_path / 'logs'}"]
    command = [str(Path(sys.executable).with_name("nemo-like")), "train", *overrides]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "rendering and tokenising" in line:  # the prompts are loading
                proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=60)
    finally:
        proc.kill()
    out = "".join(lines)
    assert status == EXIT_SIGINT and "[stop] stopped after step 0 (SIGINT)" in out, out
    assert "[setup] actors ready" not in out and "[step" not in out, out
