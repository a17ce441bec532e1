"""``nemo-like serve``'s own handling: the recipe settings it does not follow are named, and a second Ctrl-C while
it stops exits at once."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from thread_signals import signal_thread, skip_without_tgkill

from nemo_like.config import load_config
from nemo_like.serving.standalone import unused_settings


def test_settings_serve_does_not_follow_are_named() -> None:
    """eval.greedy, eval.seed and a vLLM backend changed nothing in serve, without a word (eval.model_path is what it
    serves; the default recipe has nothing to name)."""
    assert unused_settings(load_config(None, [])) == []
    assert unused_settings(load_config(None, ["eval.model_path=embedded:tiny-arith-qwen2", "policy.generation.backend=hf"])) == []
    lines = unused_settings(load_config(None, ["eval.greedy=true", "eval.seed=7", "policy.generation.backend=vllm"]))
    assert lines[0].startswith("eval.greedy, eval.seed have no effect in nemo-like serve")
    assert lines[1].startswith("policy.generation.backend=vllm has no effect in nemo-like serve")
    (line,) = unused_settings(load_config(None, ["eval.num_samples_per_prompt=4"]))
    assert line.startswith("eval.num_samples_per_prompt has no effect")


SLOW_STOP = textwrap.dedent(
    """
    import signal, sys, threading, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a parent that ignores SIGINT passes that on
    from nemo_like.config import load_config
    import nemo_like.serving.standalone as standalone
    from nemo_like.utils.stop_signals import stop_signals_raise
    stop_signals_raise()  # as the CLI does for every command

    class SlowToStop:  # the server's stop serves what was queued: up to a minute
        base_url, api_key = "http://127.0.0.1:1/v1", "key"
        class config:
            model_name = "policy"
        def start(self):
            return self
        def stop(self):
            print("stop began", file=sys.stderr, flush=True)
            time.sleep(60)

    # the real server's threads (uvicorn's, the engine's), any of which the kernel may hand a process's signal to
    other = threading.Thread(target=time.sleep, args=(600,), daemon=True)
    other.start()
    print(f"other thread: {other.native_id}", file=sys.stderr, flush=True)
    standalone.build_server = lambda cfg, port: SlowToStop()
    standalone.served_model = lambda cfg: "model"
    sys.exit(standalone.serve(load_config(None, ["eval.greedy=true"])))
    """
)


@pytest.mark.parametrize("to_other_thread", [False, True], ids=["main-thread", "other-thread"])
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_serve_warns_and_a_second_interrupt_while_it_stops_exits_at_once(name: str, to_other_thread: bool) -> None:
    """serve's stop ran with SIGINT armed: a second Ctrl-C during it raised KeyboardInterrupt out of the thread join (a
    traceback, exit 1). It now exits at once with 130 and one line; the unused settings were named at start-up. SIGTERM
    killed it without stopping the server (what was queued was dropped); it now stops as Ctrl-C does, 143. A
    subprocess: the handler ends the process it runs in. Every wait has a deadline (a broken child fails, never hangs).

    A signal the kernel handed to another of the server's threads did not wake the main thread, which alone runs
    Python's handlers: a first one was never seen (serve waited on an event forever), a second one waited for the
    stop's end (CI's run failed on it); both are now handled within 0.1 s of arriving."""
    if to_other_thread:
        skip_without_tgkill()
    signum = getattr(signal, name)
    process = subprocess.Popen([sys.executable, "-c", SLOW_STOP], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True)
    reader.start()
    err: list[str] = []

    def read_until(start: str) -> None:
        while not (line := lines.get(timeout=60)).startswith(start):
            err.append(line)

    def send() -> None:
        signal_thread(process.pid, other_thread, signum) if to_other_thread else process.send_signal(signum)

    try:
        other_thread = next(
            int(line.split(": ")[1]) for line in iter(lambda: lines.get(timeout=60), None) if line.startswith("other thread: ")
        )
        read_until("model: policy")
        send()
        read_until("stop began")
        send()
        assert process.wait(timeout=30) == 128 + signum  # within the wait, not after the stop's 60 s
        reader.join(timeout=30)
    finally:
        process.kill()
    err += list(lines.queue)
    text = "".join(err)
    assert "warning: eval.greedy has no effect in nemo-like serve" in text
    assert f"stopping the server ({name}; send it again to exit at once)" in text and f"stopped at once (a second {name})" in text
    assert "Traceback" not in text
