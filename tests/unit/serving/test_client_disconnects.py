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


def raw_calls(server: RolloutServer, bodies: list[bytes], path: str = "/v1/chat/completions") -> list[bytes]:
    """POST each body in turn on ONE keep-alive connection; each answer's bytes (b"" once the server closed it)."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(server.base_url)
    answers = []
    with socket.create_connection((url.hostname, url.port), timeout=20) as sock:
        reader = sock.makefile("rb")
        for body in bodies:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            try:
                sock.sendall(head.encode() + body)
                status = reader.readline()
                headers = {}
                while (line := reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                answers.append(status + reader.read(int(headers.get("content-length", 0))) if status else b"")
            except (ConnectionError, OSError):
                answers.append(b"")
    return answers


def test_a_500_keeps_the_connection_and_echoed_text_with_a_lone_surrogate_is_answered(served, monkeypatch) -> None:
    """An unexpected error was answered 500 by Starlette's catch-all, which then re-raised: uvicorn closed the
    connection, and the client's next call on it could be reset. A lone UTF-16 surrogate (valid JSON: a client that
    cut a string inside an emoji) in a string the answer echoes could not be UTF-8 encoded: a 500, after the call had
    taken effect."""
    import json

    import httpx

    server, engine = served
    engine.gate.set()
    ok = json.dumps({"model": "policy", "messages": USER, "max_tokens": 2}).encode()
    real_chat = server.service.chat
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("an engine bug")
        return real_chat(*args, **kwargs)

    monkeypatch.setattr(server.service, "chat", failing_once)
    failed, after = raw_calls(server, [ok, ok])
    assert failed.startswith(b"HTTP/1.1 500") and b'"type":"server_error"' in failed and b"an engine bug" in failed
    assert after.startswith(b"HTTP/1.1 200"), after  # the same connection answered the next call
    monkeypatch.setattr(server.service, "chat", real_chat)

    headers = {"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=20) as http:
        unknown = http.post("/chat/completions", content=b'{"model": "x\\ud800", "messages": [{"role": "user", "content": "hi"}]}')
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        opened = http.post("/sessions", content=b'{"session_id": "s\\ud800"}')
        assert opened.status_code == 200 and opened.json()["id"] == "s\ud800"
        assert server.sessions.end("s\ud800", reward=0.0).num_calls == 0
