"""Stopping a run on purpose: SIGTERM, SIGINT and a wall-clock deadline, and the progress the stall watchdog reads.

One :class:`RunControl` per training run (:func:`run_control` returns the active one; an inert default outside a run).
The loop (``algorithms/grpo.py`` ``run_training``) tells it when a step starts and ends and how long each save took,
and asks :meth:`RunControl.stop_reason` after each step: a first SIGTERM or SIGINT, or a deadline that the next step
plus a save would overrun, makes the loop save a checkpoint and raise :class:`RunInterrupted` (a ``SystemExit`` whose
code is the documented exit status). The current step is finished, never abandoned: a step is the unit the checkpoint
restores exactly (weights, optimizer, loader position, RNG), so stopping between two steps is what keeps the resumed
run bitwise equal to an uninterrupted one. A second SIGINT (or SIGTERM) exits at once: checkpoints are written
atomically, so the last complete one is always intact. See docs/guides/fault-tolerance.md.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from nemo_like.utils.stop_signals import STOP_SIGNALS, restore_handlers

# Exit statuses (documented in docs/guides/fault-tolerance.md).
EXIT_SIGTERM = 143  # 128 + SIGTERM: stopped by SIGTERM after saving
EXIT_SIGINT = 130  # 128 + SIGINT: stopped by Ctrl-C after saving (a second one exits at once, same status)
EXIT_DEADLINE = 75  # EX_TEMPFAIL: stopped before checkpointing.save_before after saving; rerun to continue
EXIT_STALLED = 70  # EX_SOFTWARE: the stall watchdog aborted the run (cluster.fault_tolerance.on_stall=abort)
# Kept in hand before a deadline besides 1.25 x the measured step and save: 5 s to spare and 10 s for what follows the
# stop's save, stopping the actors and a private Ray cluster (a run stopped with 5 s left exited seconds past it)
STOP_SECONDS = 15.0

_STATUS = {signal.SIGTERM: EXIT_SIGTERM, signal.SIGINT: EXIT_SIGINT}


@dataclass(frozen=True)
class StopReason:
    """Why the run stops early: ``what`` for the message, ``status`` the process exit status."""

    what: str
    status: int


class RunInterrupted(SystemExit):
    """Raised by the loop after the stop checkpoint; exits the process with :attr:`code` (the documented status)."""

    def __init__(self, reason: StopReason, step: int, checkpoint: str | None) -> None:
        super().__init__(reason.status)
        self.reason, self.step, self.checkpoint = reason, step, checkpoint


class RunControl:
    """Stop requests, the deadline, and step/save timing of one run (thread-safe enough: flags and floats)."""

    def __init__(self, deadline: float | None = None, history: int = 3, saves: bool = True) -> None:
        self.deadline = deadline  # time.time() seconds, or None
        self.saves = saves  # a stop saves a checkpoint (checkpointing.enabled): what the first signal's line says
        self.requested: StopReason | None = None
        self.step = 0  # the step in progress (0: before the first)
        self.stepping = False  # a step of this attempt (the first, or a restart's) has started: a stop finishes it
        self.last_progress = time.monotonic()
        self.step_started_at = self.step_ended_at = self.last_progress
        self._steps: deque[float] = deque(maxlen=history)
        self._saves: deque[float] = deque(maxlen=history)
        self._validations: deque[float] = deque(maxlen=history)
        self._setups: deque[float] = deque(maxlen=history)
        self._previous: dict[int, object] = {}
        self.finished = False  # the run's last step and save are done: only its summary and plot are left
        self._signalled_after_finish = False

    def run_finished(self) -> None:
        """The run is over (its records final, its last checkpoint written): a signal no longer stops a step, and the
        status stays 0 (one after the last step said "finishing step N" and exited 130 before the plot was written)."""
        self.finished = True

    # -- progress, read by the stall watchdog and the fault injector ---------------------------------------------
    def attempt_started(self) -> None:
        """An attempt (the first, or a restart's after a worker's death) begins its set-up: until its first step starts,
        a stop ends the run before any step (``self.step`` keeps the step a dead attempt was in, for its report)."""
        self.stepping = False

    def step_started(self, step: int) -> None:
        self.step, self.stepping = step, True
        self.last_progress = self.step_started_at = time.monotonic()

    def step_finished(self, validation_s: float = 0.0) -> None:
        """The step in progress ended; ``validation_s`` of it was a validation pass, timed on its own: a validation every
        ``grpo.val_period`` steps falls out of the recent steps' window, and the step before one must budget for it."""
        now = time.monotonic()
        self._steps.append(now - self.step_started_at - validation_s)
        if validation_s > 0:
            self.validation_finished(validation_s)
        self.last_progress = self.step_ended_at = now

    def validation_finished(self, seconds: float) -> None:
        """A validation pass took ``seconds`` (step 0's, outside any step, or one inside a step)."""
        self._validations.append(seconds)

    def stage_finished(self) -> None:
        """A stage of the actors' start ended (Ray's start, a role's workers ready): progress for ``setup_timeout_s``,
        which then bounds each stage, not the whole start."""
        self.last_progress = time.monotonic()

    def setup_finished(self, seconds: float) -> None:
        """The actors of an attempt (the first, or a restart's) were ready ``seconds`` after its start began."""
        self._setups.append(seconds)

    def save_finished(self) -> None:
        """A checkpoint was written since :meth:`step_finished` (its duration feeds :meth:`seconds_needed`)."""
        now = time.monotonic()
        self._saves.append(now - self.step_ended_at)
        self.last_progress = now

    # -- stopping ---------------------------------------------------------------------------------------------------
    def seconds_needed(self, validates_next: bool = False, saves_first: bool = False, restarting: bool = False) -> float:
        """Time to keep before the deadline: the slowest recent step plus the slowest recent save (before a save is
        measured, the slowest step stands for it), plus the slowest recent validation when the next step validates
        (before one is measured, the slowest step stands for it), plus one more save when ``saves_first`` (the step
        that just ended saves before the next one starts), plus the slowest start of the actors when ``restarting`` (a
        death: the restart starts them again first), with 25% to spare and :data:`STOP_SECONDS`."""
        step = max(self._steps, default=0.0)
        save = max(self._saves, default=step)
        validation = max(self._validations, default=step) if validates_next else 0.0
        setup = max(self._setups, default=0.0) if restarting else 0.0
        return 1.25 * (step + save * (2 if saves_first else 1) + validation + setup) + STOP_SECONDS

    def wants_save(self) -> bool:
        """With a deadline, save once as soon as possible (after the first step, resumed or not) to measure a save."""
        return self.deadline is not None and not self._saves

    def stop_reason(self, validates_next: bool = False, saves_first: bool = False, restarting: bool = False) -> StopReason | None:
        """A signal received, or a deadline that one more step (with its validation when ``validates_next``) and a save
        would overrun, counting the save the step that just ended makes first when ``saves_first`` (a periodic save:
        going on spends it, the next step and the stop's save) and another start of the actors when ``restarting``;
        else ``None``."""
        if self.requested is not None:
            return self.requested
        needed = self.seconds_needed(validates_next, saves_first, restarting)
        if self.deadline is not None and time.time() + needed >= self.deadline:
            left = self.deadline - time.time()
            what = "a step, its validation and a save" if validates_next else "a step and a save"
            what = f"this step's save, {what}" if saves_first else what
            what = f"a restart's start of the actors, {what}" if restarting else what
            return StopReason(f"checkpointing.save_before: {left:.0f}s left, {what} need {needed:.0f}s", EXIT_DEADLINE)
        return None

    def install_signal_handlers(self) -> None:
        """Handle SIGTERM and SIGINT in this (main) thread. Call it again after ``ray.init``: Ray's C++ failure handler
        takes SIGTERM (it prints the signal and aborts: exit status 134)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in _STATUS:
            previous = signal.signal(signum, self._on_signal)
            if previous is not self._on_signal:
                self._previous.setdefault(signum, previous)

    def restore_signal_handlers(self) -> None:
        """Put back what :meth:`install_signal_handlers` replaced first (the CLI's: :func:`stop_signals_raise`)."""
        if threading.current_thread() is not threading.main_thread():
            return
        restore_handlers(self._previous)
        self._previous.clear()
        # The caller's own streams again where a stop wrapped them (a script or notebook goes on after train()); a stream
        # replaced since (a progress bar's, restored when it stopped) is left as it is.
        sys.stdout, sys.stderr = _QuietOnBrokenPipe.unwrap(sys.stdout), _QuietOnBrokenPipe.unwrap(sys.stderr)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.finished:
            if self._signalled_after_finish:
                _say(f"[stop] second {name} after the run finished: leaving now (exit status 0)")
                os._exit(0)
            self._signalled_after_finish = True
            _say(
                f"[stop] {name} received after the run finished: exiting with status 0 once its plot is written (send it again to leave at once)"
            )
            return
        if self.requested is not None:  # the second one: leave now, the last atomic checkpoint is intact
            try:
                _say(f"[stop] second {name}: exiting now without saving (the last complete checkpoint is kept)")
            finally:
                os._exit(self.requested.status if self.requested.status in _STATUS.values() else _STATUS[signal.Signals(signum)])
        self.requested = StopReason(name, _STATUS[signal.Signals(signum)])
        if not self.stepping:  # set-up, step 0's validation, a restart's set-up: the run stops before a step, nothing new to save
            doing = (
                "before the first step: stopping there, nothing to save"
                if self.step == 0
                else "before a step began: stopping there, nothing new to save"
            )
        else:
            saving = "saving a checkpoint" if self.saves else "no checkpoint to save (checkpointing.enabled=false)"
            doing = f"during step {self.step}: finishing it, {saving}"
        _say(
            f"[stop] {name} received {doing}, then exiting with status {self.requested.status} (send it again to exit at "
            "once without saving)"
        )
        _watch_outputs()
        sys.stdout, sys.stderr = _QuietOnBrokenPipe.wrap(sys.stdout), _QuietOnBrokenPipe.wrap(sys.stderr)


class _QuietOnBrokenPipe:
    """``sys.stdout`` / ``sys.stderr`` once a stop was asked: a write or flush whose reader left after the watcher last
    looked (:func:`_watch_outputs`: a thread, which a tight loop of writes may beat) sends its fd to /dev/null and drops
    the text instead of raising into the step or the save. Anything else is the stream's own."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    @classmethod
    def wrap(cls, stream: Any) -> Any:
        return stream if stream is None or isinstance(stream, cls) else cls(stream)

    @classmethod
    def unwrap(cls, stream: Any) -> Any:
        return stream._stream if isinstance(stream, cls) else stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._silence()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._silence()

    def _silence(self) -> None:
        try:
            _to_devnull(self._stream.fileno())
            self._stream.flush()  # what the failed write left buffered goes to /dev/null now
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _to_devnull(fd: int) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _say(text: str) -> None:
    """A line on stderr from a signal handler, which must not raise: it would raise in the middle of whatever the main
    thread was doing (a step, a save). Ctrl-C on ``nemo-like train ... 2>&1 | tee run.log`` ends ``tee`` too, and
    writing to its pipe raised BrokenPipeError; an output whose reader is gone is sent to /dev/null instead
    (:func:`_silence_if_reader_gone`), so the run's later lines cannot fail the step it finishes and the save it makes
    either."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a closed pipe; a closed file object
        pass
    for fd in (1, 2):
        _silence_if_reader_gone(fd, 0)


def _watch_outputs() -> None:
    """From a stop on, a daemon thread waits on stdout and stderr for their readers to leave (``tee`` may exit after
    the handler ran: the same Ctrl-C reached it, but the scheduler decides who runs first) and silences each then.
    Once per process: a later stop (another ``train()`` call in one Python process) finds them watching."""
    if any(t.name.startswith("stop-output-watch-") and t.is_alive() for t in threading.enumerate()):
        return
    with new_threads_spared_stop_signals():  # a second signal must reach the main thread (it exits at once)
        for fd in (1, 2):
            threading.Thread(target=_silence_if_reader_gone, args=(fd, None), name=f"stop-output-watch-{fd}", daemon=True).start()


def _silence_if_reader_gone(fd: int, timeout_ms: int | None) -> None:
    """Send ``fd`` to /dev/null once it is a pipe or socket whose reading end closed (poll reports an error or a
    hang-up, which it reports whatever it was asked): at once (``timeout_ms`` 0), or whenever that happens (None)."""
    try:
        poller = select.poll()
        poller.register(fd, 0)  # errors and hang-ups only: a writable pipe does not wake it
        if not any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(timeout_ms)):
            return
        _to_devnull(fd)
    except (OSError, ValueError):
        return


_ACTIVE = RunControl()


def run_control() -> RunControl:
    """The running training's control (an inert one outside a run: no deadline, no handlers)."""
    return _ACTIVE


def activate(control: RunControl | None) -> None:
    """Make ``control`` the active one (``None``: a fresh inert one)."""
    global _ACTIVE
    _ACTIVE = control if control is not None else RunControl()


def leave_at_once_on_stop_signals(status: int) -> None:
    """From now on, SIGINT or SIGTERM ends the process at once with ``status``: for a command whose work is over and
    whose exit still runs teardown (Ray's own exit hook shuts a private cluster down: 4-8 s). A second Ctrl-C there
    raised KeyboardInterrupt inside that hook: a traceback after the run's last line, or a crash in Ray's native code
    (exit status -11 instead of the run's)."""

    def leave(signum: int, frame: FrameType | None) -> None:
        ray = sys.modules.get("ray")
        cut = ", the Ray cluster's shutdown cut short" if ray is not None and ray.is_initialized() else ""
        _say(f"[stop] {signal.Signals(signum).name} while exiting: leaving now{cut}")
        os._exit(status)

    for signum in STOP_SIGNALS:
        signal.signal(signum, leave)


@contextmanager
def new_threads_spared_stop_signals() -> Iterator[None]:
    """Threads started inside (a logger's: rich's refresh, TensorBoard's and W&B's writers) keep SIGTERM and SIGINT
    blocked for good, so the kernel delivers those signals to the main thread, where the run's handlers are. Otherwise
    a signal during ``ray.init`` could land in such a thread while Ray's own handler is installed, which aborts (134)
    instead of the deferred stop. A thread inherits its creator's signal mask; the main thread's is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
