"""SIGTERM and SIGINT for the commands besides a training run's steps (:mod:`nemo_like.utils.run_control` stops those
between steps): a stop raised as :class:`CommandStopped` so that every cleanup runs, remembered where C code swallows
it or Ray re-raises it without its type, and the signals held or ignored around ``ray.init`` and the exit status's
write. See docs/guides/fault-tolerance.md.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")

#: The signals that request a stop (the run's handlers turn them into a save and an exit status).
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


class CommandStopped(KeyboardInterrupt):
    """SIGTERM or SIGINT stopped a command other than ``train`` (which stops between steps:
    :class:`~nemo_like.utils.run_control.RunControl`). A
    ``KeyboardInterrupt``, so that it unwinds as a Ctrl-C does (every ``finally`` and cleanup runs; Ray's waits let it
    through); ``status``: 128 + the signal's number (130, 143)."""

    def __init__(self, signum: int) -> None:
        self.signal = signal.Signals(signum)
        self.status = 128 + self.signal.value  # 130, 143 (the shell's status of a process the signal ended)
        super().__init__(self.signal.name)


#: How often a main thread that waits wakes to run the signal handlers. Python runs them in the main thread only, when it
#: runs Python code; the kernel may hand a process's signal to any of its threads, and one handed to another thread does
#: not interrupt the main thread's wait (a Ctrl-C then did nothing until the wait ended: forever, for an event).
SIGNAL_POLL_S = 0.1


def wait_handling_signals(event: threading.Event) -> None:
    """``event.wait()`` that runs the signal handlers within :data:`SIGNAL_POLL_S` of a signal (their exceptions raise
    out of it), whichever thread the kernel handed the signal to."""
    while not event.wait(SIGNAL_POLL_S):
        pass


def wait_for_handling_signals(cond: threading.Condition, predicate: Callable[[], bool]) -> None:
    """``cond.wait_for(predicate)`` (``cond`` held) that runs the signal handlers within :data:`SIGNAL_POLL_S` of a
    signal where it waits in the main thread (elsewhere no thread runs them: it waits as it is)."""
    if threading.current_thread() is not threading.main_thread():
        cond.wait_for(predicate)
        return
    while not cond.wait_for(predicate, SIGNAL_POLL_S):
        pass


def join_handling_signals(thread: threading.Thread, timeout_s: float) -> None:
    """``thread.join(timeout_s)`` that runs the signal handlers within :data:`SIGNAL_POLL_S` of a signal."""
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and (left := deadline - time.monotonic()) > 0:
        thread.join(min(left, SIGNAL_POLL_S))


async def wake_for_signals() -> None:
    """A task for an event loop run in the main thread: it wakes the loop every :data:`SIGNAL_POLL_S` so that the
    signal handlers run (a loop waiting only on other threads' futures slept through a signal handed to another
    thread; ``asyncio.run`` wakes itself only where SIGINT's handler is Python's default). Cancel it when done."""
    while True:
        await asyncio.sleep(SIGNAL_POLL_S)


def call_handling_signals(fn: Callable[[], T]) -> T:
    """``fn()`` in a helper thread while the calling (main) thread waits in :func:`wait_handling_signals`: a signal
    during a long blocking call (a server's stop that joins its threads) is handled within :data:`SIGNAL_POLL_S`
    instead of when the call returns. Returns what ``fn`` returned, raises what it raised; a handler's exception
    raises here and leaves the helper (a daemon) running."""
    done = threading.Event()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"{getattr(fn, '__name__', 'call')}-handling-signals", daemon=True).start()
    wait_handling_signals(done)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


#: The stop :func:`stop_signals_raise`'s handler raised last: its exception may lose its type (``ray.get`` re-raises a
#: plain ``KeyboardInterrupt``: a SIGTERM read as a Ctrl-C) or be swallowed (an import in C code that catches it).
_RAISED: list[CommandStopped] = []


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    _RAISED[:] = [CommandStopped(signum)]
    raise _RAISED[0]


def stop_signals_raise() -> dict[int, Any]:
    """In the main thread, SIGINT and SIGTERM raise :class:`CommandStopped` (SIGTERM killed the process, its cleanups
    skipped: a merge's temporary copy stayed). ``ray.init`` replaces SIGTERM's handler (:func:`stop_signals_kept`
    puts it back). Returns the handlers it replaced, for :func:`restore_handlers` (empty off the main thread)."""
    _RAISED.clear()
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, _raise_stopped) for signum in STOP_SIGNALS}


def stop_signals_restored(previous: dict[int, Any]) -> None:
    """Undo :func:`stop_signals_raise`: ``previous`` handlers back, the stop it recorded forgotten (an in-process
    caller's next command, or ``train()``, starts clean)."""
    restore_handlers(previous)
    _RAISED.clear()


@contextmanager
def signals_ignored() -> Iterator[None]:
    """SIGTERM and SIGINT ignored through the block (in the main thread): work whose outcome is already decided (the
    exit status file) is not cut off mid-write."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.signal(signum, signal.SIG_IGN) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        restore_handlers(before)


def command_stop(exc: BaseException) -> CommandStopped:
    """The stop a ``KeyboardInterrupt`` ``exc`` stands for: itself, else the signal :func:`stop_signals_raise`'s handler
    raised last, else a Ctrl-C."""
    if isinstance(exc, CommandStopped):
        return exc
    return _RAISED[-1] if _RAISED else CommandStopped(signal.SIGINT)


def raise_if_stopped() -> None:
    """Raise the stop a signal asked for where its exception was swallowed (by C code it was raised in), before a
    command's long work starts (the whole training ran after a SIGTERM that way)."""
    if _RAISED:
        raise _RAISED[-1]


def restore_handlers(previous: dict[int, Any]) -> None:
    """Install again the ``{signal: handler}`` that a ``signal.signal`` call returned (None, a handler set outside
    Python: the default)."""
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def stop_signals_held(install: Callable[[], Any], signals: frozenset[int] = STOP_SIGNALS) -> Iterator[Callable[[], None]]:
    """Hold ``signals`` (SIGTERM and SIGINT) until Ray has started: until the yielded ``release`` is called (right
    after ``ray.init``) or the block ends; then ``install`` the command's handlers and handle what arrived.

    Processes inherit a blocked-signal mask across ``exec``: the private cluster's processes (GCS, raylet, agents, the
    workers it forks) then ignore a SIGTERM or Ctrl-C sent to the driver's whole process group (Slurm's ``srun``, a
    terminal), which would otherwise kill the GCS under the driver while it saves. ``ray.init`` also replaces SIGTERM's
    handler with Ray's (it prints the signal and aborts: status 134), and a Ctrl-C inside it could crash Ray's native
    code (status 139), so the handlers are installed after it, before a held signal is let through. Threads started
    under the mask inherit it, so none can take a signal while Ray's handler is installed."""
    held = threading.current_thread() is threading.main_thread()
    if held:
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)

    def release() -> None:
        nonlocal held
        if held:
            held = False
            install()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)

    try:
        yield release
    finally:
        release()


@contextmanager
def stop_signals_kept() -> Iterator[None]:
    """Through the block (``ray.init``), hold SIGINT (a Ctrl-C inside ``ray.init`` could crash Ray's native code: 139)
    and afterwards put back the handlers there were before it (Ray replaces SIGTERM's with one that aborts: 134). A
    command that saves nothing (``eval``) does not hold SIGTERM as ``train`` does: Ray's processes would inherit it
    held, and every exit would wait ~4 s for them (Ray's shutdown gives each 1 s to end before it kills it; they block
    SIGINT themselves). A SIGTERM during ``ray.init`` meets Ray's handler, whose ``sys.exit(15)`` is turned into the
    command's stop (143, one line)."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    with stop_signals_held(lambda: restore_handlers(before), frozenset({signal.SIGINT})):
        try:
            yield
        except SystemExit as exc:  # Ray's Python handler during ray.init: sys.exit(15), silently
            if exc.code != signal.SIGTERM:
                raise
            raise CommandStopped(signal.SIGTERM) from None
