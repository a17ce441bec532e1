"""The stall report's pieces that need no cluster, and arming a fault from the config or the environment."""

from __future__ import annotations

import threading
import time

import pytest

from nemo_like.config.errors import ConfigError
from nemo_like.config.sections.run import FaultInjectionConfig
from nemo_like.distributed import faults
from nemo_like.distributed.watchdog import driver_section, innermost_call

DUMP = """Process 2219: ray::PolicyWorker.__ray_call__
Python v3.11.7 (/usr/bin/python3.11)

Thread 2219 (idle): "MainThread"
    _hang_forever (nemo_like/distributed/faults.py:74)
    Class.__ray_call__ (ray/actor.py:2903)
    Worker.main_loop (ray/_private/worker.py:1069)
Thread 2253 (idle): "PythonGCThread"
    Condition.wait (threading.py:327)""".splitlines()


def test_the_actor_call_is_the_task_title_and_the_main_threads_innermost_frame():
    assert innermost_call(DUMP) == "PolicyWorker.__ray_call__, at _hang_forever (nemo_like/distributed/faults.py:74)"
    idle = ["Process 9: ray::EnvironmentWorker", 'Thread 9 (idle): "MainThread"', "    Worker.main_loop (ray/_private/worker.py:1069)"]
    assert innermost_call(idle) == "idle (no call running), at Worker.main_loop (ray/_private/worker.py:1069)"


def get_with_context(refs, what, timeout_s=None):  # the name and locals the report reads, as in distributed/worker_group.py
    start = time.monotonic()
    refs.wait(timeout=5)
    return what, start


def section_of_a_waiting_thread(wait) -> list[str]:
    """The stall report's driver section taken while a thread runs ``wait(release)`` (it returns once released)."""
    release = threading.Event()
    waiter = threading.Thread(target=wait, args=(release,))
    waiter.start()
    time.sleep(0.2)
    try:
        return driver_section(waiter.ident)
    finally:
        release.set()
        waiter.join()


def test_the_driver_section_names_the_call_it_waits_in_and_for_how_long():
    lines = section_of_a_waiting_thread(lambda release: get_with_context(release, "policy: inline generation"))
    assert lines[0].startswith("[stall] driver (pid") and "waiting on 'policy: inline generation' for 0." in lines[0]
    assert any("in get_with_context" in line for line in lines[1:])


def gather(calls, refs, what):  # as supervision.gather: generation engines and environments are waited on here
    started = time.monotonic()
    refs.wait(timeout=5)
    return what, started


def test_a_wait_on_a_replaceable_actor_is_named_too():
    """A hung generation engine or environment is waited on in ``supervision.gather`` (or its ``_recover``), not in
    ``get_with_context``: the report said the driver was busy in exactly the hang the watchdog is for."""
    from nemo_like.distributed import supervision, worker_group
    from nemo_like.distributed.watchdog import WAITING_CALLS
    from nemo_like.experience.async_rollouts import AsyncRollouts

    # the real names and locals (an async run waits on its collector and buffer in AsyncRollouts._wait_for)
    for function in (supervision.gather, supervision._recover, worker_group.get_with_context, AsyncRollouts._wait_for):
        assert {"what", WAITING_CALLS[function.__name__]} <= set(function.__code__.co_varnames), function
    lines = section_of_a_waiting_thread(lambda release: gather([], release, "generation"))
    assert "waiting on 'generation' for 0." in lines[0], lines[0]


def test_faults_are_armed_from_the_config_and_the_environment(monkeypatch):
    try:
        assert faults.arm(FaultInjectionConfig()) == []  # action null: nothing armed
        monkeypatch.setenv(faults.ENV_VAR, '{"step": 3, "action": "kill"}')
        [armed] = faults.arm(FaultInjectionConfig())
        assert (armed.step, armed.action, armed.role) == (3, "kill", "generation")
        # Both at once (one fault per role in one run): the config's and a list in the environment.
        monkeypatch.setenv(faults.ENV_VAR, '[{"role": "environment", "phase": "score", "action": "kill"}]')
        both = faults.arm(FaultInjectionConfig(step=2, action="kill"))
        assert [(f.role, f.step) for f in both] == [("generation", 2), ("environment", 1)]
        assert faults.disarm() == both  # neither fired: the run names them (a test built on them exercised nothing)
        monkeypatch.setenv(faults.ENV_VAR, '{"step": 3, "action": "explode"}')
        with pytest.raises(ConfigError, match="NEMO_LIKE_FAULT_INJECTION must be a JSON object .or a list of them. with the keys"):
            faults.arm(None)
        monkeypatch.setenv(faults.ENV_VAR, '{"stpe": 3, "action": "kill"}')  # a typo: one line naming the key (the CLI's exit 2)
        with pytest.raises(ConfigError, match=r"\(role, step, phase, action, times\): stpe: Extra inputs are not permitted$"):
            faults.arm(None)
    finally:
        faults.disarm()


def test_nothing_armed_or_another_step_injects_nothing():
    class NoCalls:  # any attribute access would fail: inject must not touch the worker
        def __getattr__(self, name):
            raise AssertionError(name)

    faults.disarm()
    faults.inject("generation", "generate", [NoCalls()])
    faults.arm(FaultInjectionConfig(step=5, action="hang"))
    try:
        faults.inject("generation", "generate", [NoCalls()])  # the active step is 0, not 5
    finally:
        faults.disarm()


def test_a_fault_fires_times_times_from_its_step_then_disarms(monkeypatch):
    from nemo_like.utils import run_control as rc

    queued = []

    class Worker:  # records what inject queues on it (Ray's __ray_call__)
        class __ray_call__:  # noqa: N801 - Ray's name
            @staticmethod
            def remote(action, where):
                queued.append(where)

    control = rc.RunControl()
    rc.activate(control)
    try:
        faults.arm(FaultInjectionConfig(role="environment", phase="score", step=2, action="kill", times=2))
        control.step = 1
        faults.inject("environment", "score", [Worker()])  # before its step
        control.step = 2
        faults.inject("generation", "generate", [Worker()])  # another role
        for _ in range(3):
            faults.inject("environment", "score", [Worker()])
        assert queued == ["environment/score at step 2", "environment/score at step 2"]  # twice, then disarmed
    finally:
        faults.disarm()
        rc.activate(None)


def test_an_async_run_hands_its_generation_and_environment_faults_to_the_collector():
    faults.arm(FaultInjectionConfig(role="environment", phase="score", step=2, action="kill", times=3))
    try:
        faults._ARMED[0].fired = 1  # fired once already in the driver
        [handed] = faults.hand_over(("generation", "environment"))
        assert (handed.role, handed.step, handed.times) == ("environment", 2, 2) and faults._ARMED == []
        faults.arm_specs([handed])  # in the collector's process
        assert [a.spec for a in faults._ARMED] == [handed]
    finally:
        faults.disarm()


def test_an_abort_off_the_main_thread_exits_70(tmp_path):
    """on_stall=abort with train() off the main thread: no SIGUSR1 handler is installed there, and the signal's default
    action killed the process (status -10) instead of the documented 70."""
    import subprocess
    import sys

    child = (
        "import threading, time\n"
        "from nemo_like.utils.run_control import RunControl\n"
        "from nemo_like.distributed.watchdog import StallWatchdog\n"
        "def run():\n"
        "    with StallWatchdog(RunControl(), 0.5, 'abort'):\n"
        "        time.sleep(60)\n"
        "thread = threading.Thread(target=run)\n"
        "thread.start()\n"
        "thread.join()\n"
    )
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert result.returncode == 70, (result.returncode, result.stderr[-500:])


def test_a_report_finished_after_the_watched_block_ended_neither_prints_nor_signals():
    """The report can take longer than __exit__ waits for it (py-spy per actor): once the hung call had failed and the
    run moved on (a restart), the watcher still aborted, and its SIGUSR1 met the restored default action: the driver
    died with status -10 mid-restart. A real watchdog; the report is made slow (6.5 s) in the child."""
    import subprocess
    import sys

    child = (
        "import sys, time\n"
        "from nemo_like.utils.run_control import RunControl\n"
        "from nemo_like.distributed import watchdog\n"
        "watchdog.stall_report = lambda *args: time.sleep(6.5) or '[stall] report'\n"
        "try:\n"
        "    with watchdog.StallWatchdog(RunControl(), 0.5, 'abort'):\n"
        "        time.sleep(1.0)\n"
        "        raise RuntimeError('the hung call failed')\n"
        "except RuntimeError:\n"
        "    time.sleep(2.5)  # the restart: still running when the late report is done\n"
        "print('survived', flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "survived" in result.stdout, (result.returncode, result.stderr[-500:])
    assert "[stall]" not in result.stderr, result.stderr[-500:]
