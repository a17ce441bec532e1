"""The main thread's long waits run the signal handlers within 0.1 s of a signal the kernel handed to another thread
(Python runs them in the main thread only, once it wakes): an agent batch's event loop, the teardown's rollout-server
stop, the async collector's join and pause, the engine gate's hold. Each in a real process whose other thread is sent the signal with tgkill."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
from thread_signals import signal_thread, skip_without_tgkill

CHILD = textwrap.dedent(
    """
    import sys, threading, time
    from types import SimpleNamespace

    def slow():  # what the main thread waits for: 20 s, timed by another thread (the one the signal is sent to)
        ended = threading.Event()

        def other_thread():  # says so before the wait ends: a handler run at the wait's end comes after that line
            time.sleep(0.5)  # the signal is sent on the next line: the main thread is in its wait by then
            print(f"other thread: {threading.get_native_id()}", flush=True)
            time.sleep(20)
            print("the wait ended", flush=True)
            ended.set()

        threading.Thread(target=other_thread, daemon=True).start()
        ended.wait()

    def agent_batch():  # a sync agent's session: the loop waits on its thread's future alone
        from nemo_like.data.prompts import PromptRecord
        from nemo_like.environments.agent import AgentConfig, AgentSettings
        from nemo_like.experience.agent_rollouts import AgentRollouts
        from nemo_like.serving.sessions import SessionStore
        from nemo_like.utils.stop_signals import stop_signals_raise

        stop_signals_raise()  # as the CLI's eval does
        agent = lambda base_url, api_key, session_id, prompt, metadata: slow() or 1.0
        server = SimpleNamespace(sessions=SessionStore(auto_create=False), base_url="http://127.0.0.1:1/v1", api_key="k",
                                 expect_calls=lambda session_id: None)
        settings = {"t": AgentSettings("t", AgentConfig(agent="x:y", deadline_s=60.0), agent)}
        agents = AgentRollouts(server, settings, SimpleNamespace(pad_token_id=0), SimpleNamespace(weight_version=0))
        prompt = PromptRecord("p", [{"role": "user", "content": "q"}], [1, 2], {"task_name": "t"})
        agents.collect(SimpleNamespace(tasks=["t"]), [prompt], 1, seed=0)

    def teardown():  # a run's teardown after a first stop: the rollout server serves what was queued
        from nemo_like.algorithms.setup import GRPOComponents
        from nemo_like.utils.run_control import RunControl, StopReason

        control = RunControl()
        control.install_signal_handlers()
        control.requested = StopReason("SIGINT", 130)  # the second signal exits at once with the first one's status
        parts = SimpleNamespace(agents=SimpleNamespace(server=SimpleNamespace(stop=slow)), generation=None,
                                policy=None, reference=None, teacher=None, environments=None)
        GRPOComponents.shutdown(parts)

    def collector_join():  # the async run's stop waits for its collector thread
        from nemo_like.utils.stop_signals import join_handling_signals, stop_signals_raise

        stop_signals_raise()
        thread = threading.Thread(target=slow, daemon=True)
        thread.start()
        join_handling_signals(thread, 30)

    def collector_pause():  # an async agent run's checkpoint or validation holds the driver's collector: the batch in flight
        from nemo_like.experience.trajectory_collector import TrajectoryCollector
        from nemo_like.utils.stop_signals import stop_signals_raise

        stop_signals_raise()
        cond = threading.Condition()
        collector = SimpleNamespace(cond=cond, pause_reasons=set(), failure=None, in_flight=True, paused=False, stopping=False,
                                    pushing=0, version=0, _pause_started={}, _nothing_left_to_generate=lambda: False,
                                    pacer=SimpleNamespace(can_start=lambda version: True))

        def batch_in_flight():
            slow()
            with cond:
                collector.in_flight, collector.paused = False, True
                cond.notify_all()

        threading.Thread(target=batch_in_flight, daemon=True).start()
        TrajectoryCollector.pause(collector, "checkpoint")

    def engine_hold():  # a refit of an agent run holds the rollout server's engine: the engine call in flight
        from nemo_like.experience.agent_rollouts import EngineGate
        from nemo_like.utils.stop_signals import stop_signals_raise

        stop_signals_raise()
        gate = EngineGate(SimpleNamespace(generate=lambda *args: slow()))
        threading.Thread(target=gate.generate, args=([[1]], None, 0), daemon=True).start()
        while gate.calls == 0:
            time.sleep(0.01)
        gate.hold()

    waits = {"agent_batch": agent_batch, "teardown": teardown, "collector_join": collector_join, "collector_pause": collector_pause,
             "engine_hold": engine_hold}
    from nemo_like.utils.stop_signals import CommandStopped

    try:
        waits[sys.argv[1]]()
    except CommandStopped as exc:  # the CLI's handler raised it (wherever the main thread was)
        print(f"stopped: {exc.signal.name}", flush=True)
    """
)


@pytest.mark.parametrize("wait", ["agent_batch", "teardown", "collector_join", "collector_pause", "engine_hold"])
def test_a_signal_handed_to_another_thread_stops_the_main_threads_wait_at_once(wait: str) -> None:
    """Before: the agent batch's loop (sync agents: nothing woke it) missed the signal until the session ended (its
    deadline_s: 60 s by default), the teardown's server stop (up to 90 s), the collector's join (30 s) and its pause for
    a checkpoint or a validation (an agent batch's deadline_s: the collector is the driver's in agent runs) and a refit's
    hold of the engine (an engine call) held a second
    one ("exit at once") until they returned. Each wait here is 20 s; the signal must act before it ends."""
    skip_without_tgkill()
    process = subprocess.Popen([sys.executable, "-c", CHILD, wait], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("other thread: "), line + process.stderr.read()
        signal_thread(process.pid, int(line.split(": ")[1]), signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert "wait ended" not in out, "the main thread handled the signal only once its wait ended"
    if wait == "teardown":
        assert process.returncode == 130 and "second SIGINT: exiting now" in err, err
    else:
        assert process.returncode == 0 and out.strip() == "stopped: SIGINT", out + err
