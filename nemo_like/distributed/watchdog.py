"""The stall watchdog: a hung call never hangs a run silently (``cluster.fault_tolerance.stall_timeout_s``).

A daemon thread in the driver checks the run's progress (:class:`~nemo_like.utils.run_control.RunControl`: a step
started or ended, a save finished). After ``stall_timeout_s`` without progress it prints one report:

* the driver: the call it waits in, named as the loop names it (the ``what`` of ``get_with_context``, e.g.
  ``'policy: inline generation'``) and for how long, and its Python stack;
* every live actor of this Ray job (class, actor id, pid, node): the call it is in and since when (Ray's state API,
  when the cluster runs a dashboard; else the innermost call of its stack), and its Python stack (``py-spy dump``,
  for actors on this node).

``on_stall=warn`` then keeps waiting (a new report after each further ``stall_timeout_s``); ``abort`` exits the run
with status 70 (:data:`~nemo_like.utils.run_control.EXIT_STALLED`): the report is raised as :class:`RunStalled` in the
main thread (Ray's ``ray.get`` runs Python signal handlers while it waits and lets a ``KeyboardInterrupt`` through), and if the driver does not leave within
15 s the process exits hard. Checkpoints are atomic: the last complete one is intact either way.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any

from nemo_like.utils.run_control import EXIT_STALLED, RunControl

ABORT_GRACE_S = 15.0


class RunStalled(SystemExit):
    """The run made no progress for ``stall_timeout_s`` and ``on_stall=abort``: exits with status 70."""

    def __init__(self, report: str) -> None:
        super().__init__(EXIT_STALLED)
        self.report = report


class StallWatchdog:
    """Report (and optionally abort) a run whose :class:`RunControl` shows no progress for ``timeout_s``."""

    def __init__(
        self, control: RunControl, timeout_s: float, on_stall: str, key: str = "stall_timeout_s", during: str | None = None
    ) -> None:
        """``key``: the setting ``timeout_s`` came from (named in the report); ``during``: what is watched (default: the
        step under way, ``during step N``), e.g. ``"set-up"``."""
        self.control, self.timeout_s, self.on_stall = control, timeout_s, on_stall
        self.key, self.during = key, during
        self.main_thread_id = threading.main_thread().ident
        self._stop = threading.Event()
        # Held from the watcher's last look at _stop to its SIGUSR1: __exit__ waits for it before putting the old
        # handler back, so the signal never meets the default action (which would kill the process, status -10).
        self._signalling = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="nemo-like-stall-watchdog", daemon=True)
        self._report: str | None = None
        self.aborted = False
        self._previous: object = None
        self._interrupts_main = False  # abort through the main thread's SIGUSR1 handler (installed in __enter__)

    def __enter__(self) -> StallWatchdog:
        self._interrupts_main = self.on_stall == "abort" and threading.current_thread() is threading.main_thread()
        if self._interrupts_main:
            self._previous = signal.signal(signal.SIGUSR1, self._raise_in_main)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._stop.set()
        with self._signalling:  # a report finished after this point is dropped: the block it was about has ended
            pass
        self._thread.join(timeout=5)
        if self._previous is not None:
            signal.signal(signal.SIGUSR1, self._previous)  # type: ignore[arg-type]
        if self.aborted and exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            raise RunStalled(self._report or "stalled") from None

    def _watch(self) -> None:
        reported_at = None
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self.control.last_progress
            since = self.control.last_progress if reported_at is None else max(reported_at, self.control.last_progress)
            if idle < self.timeout_s or time.monotonic() - since < self.timeout_s:
                continue
            reported_at = time.monotonic()
            report = stall_report(self.control, idle, self.timeout_s, self.main_thread_id, self.key, self.during)  # py-spy per actor
            with self._signalling:
                if self._stop.is_set():
                    return  # the watched call ended (an error, a restart) while the report was built: no stall left
                self._report = report
                print(report, file=sys.stderr, flush=True)
                if self.on_stall == "abort":
                    self._abort()
            if self.aborted:
                self._wait_for_the_main_thread()
                return

    def _abort(self) -> None:
        """Interrupt the main thread (call with ``_signalling`` held and ``_stop`` not set)."""
        print(f"[stall] cluster.fault_tolerance.on_stall=abort: stopping the run (exit status {EXIT_STALLED})", file=sys.stderr, flush=True)
        self.aborted = True
        if not self._interrupts_main:  # run off the main thread: no SIGUSR1 handler to interrupt it (the signal's
            os._exit(EXIT_STALLED)  # default action would kill the process with another status)
        os.kill(os.getpid(), signal.SIGUSR1)

    def _wait_for_the_main_thread(self) -> None:
        if not self._stop.wait(ABORT_GRACE_S):
            print(f"[stall] the driver did not stop within {ABORT_GRACE_S:.0f}s: exiting now", file=sys.stderr, flush=True)
            os._exit(EXIT_STALLED)

    def _raise_in_main(self, signum: int, frame: FrameType | None) -> None:
        # A KeyboardInterrupt is what Ray's ray.get lets through from a signal handler (it turns other exceptions,
        # SystemExit included, into its own exit); __exit__ turns it into RunStalled. Once __exit__ has begun, the
        # block is left already (by its own error or result): nothing to interrupt.
        if not self._stop.is_set():
            raise KeyboardInterrupt("stall watchdog abort")


def stall_report(
    control: RunControl,
    idle_s: float,
    timeout_s: float,
    main_thread_id: int | None,
    key: str = "stall_timeout_s",
    during: str | None = None,
) -> str:
    """The whole report: the driver's call and stack, then every actor's."""
    where = during or f"step {control.step}"
    lines = [f"[stall] no progress for {idle_s:.0f}s (cluster.fault_tolerance.{key}={timeout_s:g}) during {where}"]
    lines += driver_section(main_thread_id)
    import ray

    if ray.is_initialized():  # Ray's state calls would otherwise start a cluster (tens of seconds) to report nothing
        calls = running_calls()
        for actor in job_actors():
            lines += actor_section(actor, calls, local_node_id())
    lines.append("[stall] end of report")
    return "\n".join(lines)


#: The driver's waits on actor calls: function name -> its local holding the wait's start (``time.monotonic``); each
#: has the phase in ``what``. ``get_with_context`` (policy, reference, collector calls), the supervised calls of
#: replaceable actors (generation engines, environments: ``supervision.gather`` and its ``_recover``) and an async run's
#: waits on its collector and replay buffer (``AsyncRollouts._wait_for``).
WAITING_CALLS = {"get_with_context": "start", "gather": "started", "_recover": "started", "_wait_for": "started"}


def driver_section(main_thread_id: int | None) -> list[str]:
    """The driver's main thread: the actor call it waits in (:data:`WAITING_CALLS`; for how long), and its stack."""
    frame = sys._current_frames().get(main_thread_id or -1)
    if frame is None:
        return ["[stall] driver: main thread not found"]
    call = "no actor call (the driver itself is busy)"
    walker: FrameType | None = frame
    while walker is not None:
        start_name = WAITING_CALLS.get(walker.f_code.co_name)
        if start_name is not None and "what" in walker.f_locals:
            started = walker.f_locals.get(start_name)
            waited = f" for {time.monotonic() - started:.1f}s" if isinstance(started, float) else ""
            call = f"waiting on '{walker.f_locals['what']}'{waited}"
            break
        walker = walker.f_back
    stack = "".join(traceback.format_stack(frame)).rstrip().splitlines()
    return [f"[stall] driver (pid {os.getpid()}): {call}", *(f"    {line}" for line in stack[-24:])]


def job_actors() -> list[dict[str, Any]]:
    """The live actors of this Ray job, from the GCS actor table (works without a dashboard)."""
    import ray

    try:
        job = ray.get_runtime_context().get_job_id()
        table = ray._private.state.actors()  # noqa: SLF001 - the public state API needs the dashboard
    except Exception as exc:  # noqa: BLE001 - a report must not fail
        return [{"error": f"could not list actors: {exc}"}]
    return [a for a in table.values() if a.get("State") == "ALIVE" and a.get("JobID") == job]


def running_calls() -> dict[str, tuple[str, float]]:
    """Actor id -> (running call, seconds in it), from Ray's state API; empty when the cluster has no dashboard."""
    try:
        from ray.util.state import list_tasks

        tasks = list_tasks(filters=[("state", "=", "RUNNING")], timeout=5, raise_on_missing_output=False)
    except Exception:  # noqa: BLE001 - private clusters run without a dashboard
        return {}
    now_ms = time.time() * 1000
    return {t.actor_id: (t.name, (now_ms - (t.start_time_ms or now_ms)) / 1000) for t in tasks if getattr(t, "actor_id", None)}


def local_node_id() -> str | None:
    """This driver's Ray node id (py-spy reaches only the processes of this node)."""
    import ray

    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - a report must not fail
        return None


def actor_section(actor: dict[str, Any], calls: dict[str, tuple[str, float]], node_id: str | None) -> list[str]:
    """One actor: class, id, pid, the call it is in, and its Python stack (py-spy, for actors on this node)."""
    if "error" in actor:
        return [f"[stall] {actor['error']}"]
    actor_id, pid, address = actor["ActorID"], actor.get("Pid"), actor.get("Address", {})
    head = f"[stall] actor {actor['ActorClassName']} {actor_id[:12]} (pid {pid}, node {address.get('IPAddress')})"
    on_this_node = node_id is None or address.get("NodeID") == node_id
    stack = py_spy_stack(pid) if on_this_node else ["(no stack: the actor runs on another node; py-spy dump --pid there)"]
    if actor_id in calls:
        name, seconds = calls[actor_id]
        call = f"in {name} for {seconds:.1f}s"
    else:
        call = f"in {innermost_call(stack)}"
    return [f"{head}: {call}", *(f"    {line}" for line in stack)]


def py_spy_stack(pid: int | None, timeout_s: float = 10.0) -> list[str]:
    """``py-spy dump --pid``'s lines (innermost call first), or one line saying why there is none."""
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not pid or not os.path.exists(f"/proc/{pid}"):
        return ["(no stack: the process is not on this node)"]
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"(no stack: py-spy failed: {exc})"]
    text = out.stdout.strip() or out.stderr.strip()
    return text.splitlines() or ["(no stack: py-spy printed nothing)"]


def innermost_call(stack: list[str]) -> str:
    """The call an actor runs, from a ``py-spy dump``: Ray's task name from the process title (``ray::Class.method``)
    and the innermost frame of the main thread (where it is stuck)."""
    task = next((line.split(": ", 1)[1].strip() for line in stack if line.startswith("Process ") and ": " in line), "")
    main: list[str] = []
    for line in stack:
        if line.startswith("Thread "):
            if main or '"MainThread"' not in line:
                if main:
                    break
                continue
            main.append(line)
        elif main and line.startswith("    "):
            main.append(line.strip())
    where = main[1] if len(main) > 1 else "an unknown frame"
    if task and "." not in task:  # Ray titles an actor between calls with its class name alone
        return f"idle (no call running), at {where}"
    return f"{task.removeprefix('ray::') or 'an unknown call'}, at {where}"
