"""Rollout-server overhead: seconds per turn through HTTP (the real ``openai`` client, the real server) vs the same
prompts through the engine directly, for sessions of 1 and 8 turns.

Usage: python benchmarks/agent_server.py [--sessions 8] [--turns 1 8] [--max-tokens 12] [--repeats 5]
       [--client stdlib raw openai] [--mode greedy seeded]

Each of ``--sessions`` agents (threads of this process, each with its own client and open connection) runs a session
of T turns against the shipped tiny tool model: call, append the answer and a tool message, call again. The HTTP time
is the wall time of all sessions together. Right after it, the replay sends, per turn, every session's recorded prompt
ids of that turn as one ``engine.generate`` batch with the same settings; its time is the engine's share. Overhead =
HTTP / engine - 1, per repeat (each HTTP run beside its own replay), printed as the median [min, max] over
``--repeats``: rendering, tokenising, HTTP, JSON, recording, batches split by arrival times, and the client's own
Python, which runs in this process too, as a training run's agents run in the driver beside the server.

``--mode greedy``: temperature 0, no session (each call renders and tokenises its whole history). ``--mode seeded``:
what a training run does: each session is opened with a seed (a call samples with ``agent_call_seed(seed, its prompt ids, 0, its settings)``), calls
carry ``X-Session-Id`` (the server reuses the session's ids), temperature 1; the replay samples each turn's prompts in
one engine call with the same per-prompt seeds and must draw exactly the served tokens (checked). ``raw``: plain JSON
over ``httpx``; ``openai``: the ``openai`` package; ``stdlib``: ``http.client`` (about the least a client costs).

An engine without per-prompt seeds (before they existed) replays seeded turns with one int seed: timed, not compared.

Measured 2026-12-03 on the quiet 2-core CPU (load 0.3-0.7), ``--turns 8``, one invocation's median per cell, this
version and 8acecaf (before agents' first calls were expected and before answers skipped FastAPI's response encoding;
run through ``PYTHONPATH``) interleaved in two pairs; engine calls per turn after the overhead (the replay: 1)::

    python benchmarks/agent_server.py --repeats 5 --turns 8

    8 sessions x 8 turns    8acecaf             now
    seeded, stdlib client   -                   +30%, +20% (3 more runs: +28 +35 +22); 1.0
    seeded, raw client      +39%, +44%; 1.0     +42%, +41%; 1.0
    seeded, openai client   +100%, +94%; 1.1    +88%, +83%; 1.0
    greedy, stdlib client   -                   +32%, +34%; 1.0
    greedy, raw client      +66%, +45%; 1.1     +40%, +49%; 1.0
    greedy, openai client   +77%, +82%; 1.0     +88%, +81%; 1.0

Back to back with the commit before the matmuls ran through oneDNN (fcdc3fe against 40bed55, one invocation each):
the engine's turn went from ~22 to ~16 ms and the server's milliseconds stayed, so seeded stdlib +16% -> +32%, raw
+53% -> +50%, openai +85% -> +114% (docs/guides/agents.md). Seeded replays drew exactly the served tokens (0 differ)
in every run. What remains is Python that the engine waits
for: 8 sessions' calls of a turn run one after another under the GIL while a tiny-model turn samples in ~30 ms. One
call (sequential, an engine that answers at once, a 9-message history) costs 0.9-1.1 ms through ``stdlib``, 1.1-1.5 ms
through ``raw`` and 3.0-3.6 ms through ``openai``; the server's completion service takes 0.45 ms of it. The history
of these figures is in docs/guides/agents.md#concurrency-and-batching.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import statistics
import threading
import time
import urllib.parse
from collections.abc import Iterator

import httpx
import openai
import torch

from nemo_like.models.generation.interface import SamplingParams
from nemo_like.models.loading import load_tokenizer
from nemo_like.serving import RolloutServer, ServerConfig
from nemo_like.serving.app import SESSION_HEADER
from nemo_like.serving.local_engine import LocalGeneration
from nemo_like.serving.sessions import call_settings
from nemo_like.utils.seeds import agent_call_seed

MODEL = "embedded:tiny-tool-qwen2"
TEMPERATURE = {"greedy": 0.0, "seeded": 1.0}


def chat_body(messages: list, max_tokens: int, temperature: float) -> dict:
    """The JSON body every client sends (with ``return_token_ids``: the ids the replay needs)."""
    return {"model": "policy", "messages": messages, "temperature": temperature, "max_tokens": max_tokens, "return_token_ids": True}


def reply_ids(reply: dict) -> tuple[list[int], list[int], str]:
    """A JSON reply's prompt ids, first choice's completion ids and content."""
    choice = reply["choices"][0]
    return reply["prompt_token_ids"], choice["completion_token_ids"], choice["message"]["content"] or ""


class Client:
    """What the clients share: the session they call in (``session_id``), sent as ``X-Session-Id``."""

    session_id: str | None = None

    def use_session(self, session_id: str) -> None:
        self.session_id = session_id
        self._send_session_header(session_id)

    def _send_session_header(self, session_id: str) -> None:
        raise NotImplementedError


class RawClient(Client):
    """The same call as plain JSON over one kept-alive ``httpx`` connection (a client that costs little)."""

    def __init__(self, server: RolloutServer) -> None:
        self.http = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"})

    def _send_session_header(self, session_id: str) -> None:
        self.http.headers[SESSION_HEADER] = session_id

    def chat(self, messages: list, max_tokens: int, temperature: float) -> tuple[list[int], list[int], str]:
        return reply_ids(self.http.post("/chat/completions", json=chat_body(messages, max_tokens, temperature)).json())


class StdlibClient(Client):
    """The same call through ``http.client`` (the standard library) on one kept-alive connection: about the least a
    Python client can cost, so what remains of the overhead is the server's own."""

    def __init__(self, server: RolloutServer) -> None:
        url = urllib.parse.urlsplit(server.base_url)
        self.connection = http.client.HTTPConnection(url.hostname, url.port)
        self.path = f"{url.path}/chat/completions"
        self.headers = {"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"}

    def _send_session_header(self, session_id: str) -> None:
        self.headers[SESSION_HEADER] = session_id

    def chat(self, messages: list, max_tokens: int, temperature: float) -> tuple[list[int], list[int], str]:
        body = json.dumps(chat_body(messages, max_tokens, temperature)).encode()  # bytes: one send with the headers
        self.connection.request("POST", self.path, body, self.headers)
        return reply_ids(json.loads(self.connection.getresponse().read()))


class OpenAIClient(Client):
    """The call through the ``openai`` package (what agents use; its own Python costs a few ms per call)."""

    def __init__(self, server: RolloutServer) -> None:
        self.client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)

    def _send_session_header(self, session_id: str) -> None:
        self.client = self.client.with_options(default_headers={SESSION_HEADER: session_id})  # the same connection

    def chat(self, messages: list, max_tokens: int, temperature: float) -> tuple[list[int], list[int], str]:
        reply = self.client.chat.completions.create(
            model="policy", messages=messages, temperature=temperature, max_tokens=max_tokens, extra_body={"return_token_ids": True}
        )
        choice = reply.choices[0]
        return reply.prompt_token_ids, choice.model_extra["completion_token_ids"], choice.message.content or ""


CLIENTS = {"stdlib": StdlibClient, "raw": RawClient, "openai": OpenAIClient}


def run_sessions(
    server: RolloutServer, clients: list, turns: int, max_tokens: int, temperature: float
) -> tuple[float, list[list[tuple[list[int], list[int]]]]]:
    """Wall seconds of one concurrent agent per client, ``turns`` turns each (clients, threads and connections are
    ready before the clock starts); per session, the (prompt ids, completion ids) of each turn. A client with a session
    is started and ended as a run does it (:class:`~nemo_like.experience.agent_rollouts.AgentRollouts`): the server
    expects its calls from the start, and the session ends when the agent returns."""
    calls: list[list[tuple[list[int], list[int]]]] = [[] for _ in clients]
    ready = threading.Barrier(len(clients) + 1)

    def agent(i: int) -> None:
        messages = [{"role": "user", "content": f"What is {120 + i} times {13 + i}?"}]
        session_id = clients[i].session_id
        if session_id is not None:
            server.expect_calls(session_id)
        ready.wait()
        for _ in range(turns):
            prompt_ids, completion_ids, content = clients[i].chat(messages, max_tokens, temperature)
            calls[i].append((prompt_ids, completion_ids))
            messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": "42"}]
        if session_id is not None:
            server.sessions.end(session_id)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - start, calls


def replay(engine: LocalGeneration, calls: list, max_tokens: int, session_seeds: list[int] | None) -> tuple[float, int]:
    """Seconds for the engine alone (one batch per turn of every session's prompt at that turn), and how many sampled
    tokens differ from the served ones (seeded mode with per-prompt seeds; 0 otherwise: not compared)."""
    params = SamplingParams(max_new_tokens=max_tokens, greedy=session_seeds is None, temperature=1.0)
    compare = session_seeds is not None and getattr(engine, "PER_PROMPT_SEEDS", False)
    differ, seconds = 0, 0.0
    for turn in range(len(calls[0])):
        prompts = [c[turn][0] for c in calls]
        seed = [agent_call_seed(s, c[turn][0], 0, call_settings(params)) for s, c in zip(session_seeds, calls)] if compare else 0
        start = time.perf_counter()
        samples = engine.generate(prompts, params, seed)
        seconds += time.perf_counter() - start
        if compare:
            differ += sum(s.response_ids[: len(c[turn][1])] != c[turn][1] for s, c in zip(samples, calls))
    return seconds, differ


def new_sessions(server: RolloutServer, clients: list, mode: str, numbers: Iterator[int]) -> list[int] | None:
    """Seeded mode: a fresh seeded session per client (as a run opens one per sample), and their seeds."""
    if mode == "greedy":
        return None
    seeds = [next(numbers) for _ in clients]
    for client, seed in zip(clients, seeds):
        client.use_session(server.sessions.open(metadata={"seed": seed}))
    return seeds


def spread(values: list[float], scale: float = 1.0, fmt: str = ".1f") -> str:
    """``median [min, max]`` of ``values`` times ``scale``."""
    v = sorted(x * scale for x in values)
    return f"{statistics.median(v):{fmt}} [{v[0]:{fmt}}, {v[-1]:{fmt}}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--client", choices=list(CLIENTS), nargs="+", default=list(CLIENTS))
    parser.add_argument("--mode", choices=["greedy", "seeded"], nargs="+", default=["greedy", "seeded"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(MODEL)
    engine = LocalGeneration.load(MODEL, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    with RolloutServer(engine, tokenizer, ServerConfig(auto_create_sessions=True)) as server:
        stats, opened = server.queue.stats, itertools.count(1000)
        for mode, kind, turns in [(m, k, t) for m in args.mode for k in args.client for t in args.turns]:
            temperature = TEMPERATURE[mode]
            clients = [CLIENTS[kind](server) for _ in range(args.sessions)]

            new_sessions(server, clients, mode, opened)
            run_sessions(server, clients, 1, args.max_tokens, temperature)  # warm-up: every client opens its connection
            http, direct, overhead, differ = [], [], [], 0
            calls_before, waits_before = stats.engine_calls, getattr(stats, "waits", 0)
            for _ in range(args.repeats):
                seeds = new_sessions(server, clients, mode, opened)
                seconds, calls = run_sessions(server, clients, turns, args.max_tokens, temperature)
                engine_s, bad = replay(engine, calls, args.max_tokens, seeds)
                http.append(seconds / turns)
                direct.append(engine_s / turns)
                overhead.append(seconds / engine_s - 1)
                differ += bad
            per_turn = (stats.engine_calls - calls_before) / (turns * args.repeats)
            print(
                f"{mode:6s} {kind:6s} client, {turns} turn(s), {args.sessions} sessions: HTTP {spread(http, 1000)} ms/turn, "
                f"engine {spread(direct, 1000)} ms/turn; overhead {spread(overhead, 100, '+.0f')}% "
                f"(server engine calls per turn {per_turn:.2f}, replay 1; waits for callers {getattr(stats, 'waits', 0) - waits_before}"
                + (f"; replayed tokens that differ from the served ones: {differ}" if mode == "seeded" else "")
                + ")",
                flush=True,
            )


if __name__ == "__main__":
    main()
