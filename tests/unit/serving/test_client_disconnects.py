"""A call whose client leaves before the answer (a timeout, a killed agent) is cancelled, not recorded: its completion
was never seen by the agent, so training on it (with the session's reward) would credit text the agent did not act on.
Against the real server, the real ``openai`` client and the shipped tiny model's engine, held at a gate so that the
client's timeout fires while its call waits or runs."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from nemo_like.models.loading import load_tokenizer
from nemo_like.serving.local_engine import LocalGeneration
from nemo_like.serving.server import RolloutServer, ServerConfig
from nemo_like.serving.sessions import BUDGET_KEY

MODEL = "embedded:tiny-tool-qwen2"
USER = [{"role": "user", "content": "What is 12 times 7?"}]


class Gated:
    """The local engine, with each call held at ``gate`` (``entered`` set once a call waits there)."""

    def __init__(self, engine: LocalGeneration) -> None:
        self.engine, self.calls = engine, 0
        self.gate, self.entered = threading.Event(), threading.Event()
        self.PER_PROMPT_SEEDS = engine.PER_PROMPT_SEEDS

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, prompts, params, seed):
        self.entered.set()
        assert self.gate.wait(30)
        self.calls += 1
        return self.engine.generate(prompts, params, seed)


@pytest.fixture(scope="module")
def served():
    tokenizer = load_tokenizer(MODEL)
    engine = Gated(LocalGeneration.load(MODEL, tokenizer.pad_token_id, [tokenizer.eos_token_id]))
    with RolloutServer(engine, tokenizer, ServerConfig(max_context=512)) as server:
        yield server, engine


def client(server: RolloutServer, session_id: str, timeout: float | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.base_url, api_key=server.api_key, default_headers={"X-Session-Id": session_id}, max_retries=0, timeout=timeout
    )


def ask(server: RolloutServer, session_id: str, timeout: float | None = None):
    return client(server, session_id, timeout).chat.completions.create(
        model="policy", messages=USER, max_tokens=8, temperature=1.0, extra_body={"return_token_ids": True}
    )


def wait_for(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the server did not notice the client leave"
        time.sleep(0.02)


def test_a_call_whose_client_timed_out_is_not_recorded_and_its_retry_is(served) -> None:
    """The client times out while its call is being sampled; its retry is answered. The session holds the retry's
    completion alone (before: both, the first never seen by the agent), its reservation is back once its engine call
    ended (not before: a retry would reserve the budget again while it is still sampled), the call is counted."""
    server, engine = served
    session = server.sessions.open("timed-out", {BUDGET_KEY: 100})
    engine.gate.clear()
    engine.entered.clear()
    with pytest.raises(openai.APITimeoutError):
        ask(server, session, timeout=0.5)  # the engine call started (held), then the client gave up
    assert engine.entered.is_set()
    store_session = server.sessions.session(session)
    wait_for(lambda: store_session.abandoned_calls == 1)
    assert store_session.reserved_tokens == 8  # kept while the engine still samples the abandoned call
    engine.gate.set()
    wait_for(lambda: store_session.reserved_tokens == 0)  # its engine call ended: its 8 tokens are given back
    answer = ask(server, session)
    assert store_session.reserved_tokens == 0
    result = server.sessions.end(session, 1.0)
    assert len(result.rows) == 1 and result.num_calls == 1 and result.abandoned_calls == 1
    row = result.rows[0]
    assert row.calls == [(1, 0)]  # the retry (call 1) alone: call 0's completion is in no row
    assert row.response_ids == answer.choices[0].model_extra["completion_token_ids"]
    assert server.sessions.metrics()["agent/abandoned_calls"] >= 1.0


def test_a_call_given_up_while_it_waits_is_never_sampled(served) -> None:
    """A call queued behind a running engine call whose client leaves is dropped before the engine sees it."""
    server, engine = served
    engine.gate.clear()
    engine.entered.clear()
    first = threading.Thread(target=ask, args=(server, server.sessions.open("runs")))
    first.start()
    assert engine.entered.wait(20)
    calls, cancelled = engine.calls, server.queue.stats.cancelled
    waiting = server.sessions.open("waits")
    with pytest.raises(openai.APITimeoutError):
        ask(server, waiting, timeout=0.5)
    wait_for(lambda: server.sessions.session(waiting).abandoned_calls == 1)
    engine.gate.set()
    first.join(30)
    wait_for(lambda: server.queue.stats.cancelled == cancelled + 1)
    assert engine.calls == calls + 1  # the first call only
    result = server.sessions.end(waiting, 0.0)
    assert result.rows == [] and result.abandoned_calls == 1
