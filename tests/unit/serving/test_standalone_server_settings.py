"""``nemo-like serve``'s own handling: the recipe settings it does not follow are named, and a second Ctrl-C while
it stops is ignored."""

from __future__ import annotations

import os
import signal
import time

import pytest

from nemo_like.config import load_config
from nemo_like.serving.standalone import ignored_interrupts, unused_settings


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


def test_a_second_interrupt_while_the_server_stops_is_ignored() -> None:
    """serve's stop ran with SIGINT armed: a second Ctrl-C during its ~1 s raised KeyboardInterrupt out of the thread
    join (a traceback, exit 1). Inside ignored_interrupts a SIGINT does nothing; the handler is back after."""
    before = signal.getsignal(signal.SIGINT)
    with ignored_interrupts():
        os.kill(os.getpid(), signal.SIGINT)  # delivered at once to this (main) thread: raised KeyboardInterrupt before
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt):  # the control: the same signal outside raises
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
