"""Rollout-server overhead: seconds per turn through HTTP (the real ``openai`` client, the real server) vs the same
prompts through the engine directly, for sessions of 1 and 8 turns.

Usage: python benchmarks/agent_server.py [--sessions 8] [--turns 1 8] [--max-tokens 12] [--repeats 3] [--client raw openai]

Each of ``--sessions`` agents (threads of this process, each with its own client and open connection) runs a session of T turns against the shipped tiny tool model (greedy, so a
replay samples the same tokens): call, append the answer and a tool message, call again. The HTTP time is the wall
time of all sessions together. The replay then sends, per turn, every session's recorded prompt ids of that turn as
one ``engine.generate`` batch with the same settings; its time is the engine's share. Overhead = HTTP / engine - 1
(rendering, tokenising, HTTP, JSON, recording, batches split by arrival times, and the client's own Python, which runs
in this process too). ``raw``: plain JSON over ``httpx``; ``openai``: the ``openai`` package. Medians over
``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx
import openai
import torch

from nemo_like.models.generation.interface import SamplingParams
from nemo_like.models.loading import load_tokenizer
from nemo_like.serving import RolloutServer, ServerConfig
from nemo_like.serving.local_engine import LocalGeneration

MODEL = "embedded:tiny-tool-qwen2"


class RawClient:
    """The same call as plain JSON over one kept-alive ``httpx`` connection (a client that costs ~nothing)."""

    def __init__(self, server: RolloutServer) -> None:
        self.http = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {server.api_key}"})

    def chat(self, messages: list, max_tokens: int) -> tuple[list[int], str]:
        body = {"model": "policy", "messages": messages, "temperature": 0, "max_tokens": max_tokens, "return_token_ids": True}
        reply = self.http.post("/chat/completions", json=body).json()
        return reply["prompt_token_ids"], reply["choices"][0]["message"]["content"] or ""


class OpenAIClient:
    """The call through the ``openai`` package (what agents use; its own Python costs a few ms per call)."""

    def __init__(self, server: RolloutServer) -> None:
        self.client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)

    def chat(self, messages: list, max_tokens: int) -> tuple[list[int], str]:
        reply = self.client.chat.completions.create(
            model="policy", messages=messages, temperature=0, max_tokens=max_tokens, extra_body={"return_token_ids": True}
        )
        return reply.prompt_token_ids, reply.choices[0].message.content or ""


def run_sessions(clients: list, turns: int, max_tokens: int) -> tuple[float, list[list[list[int]]]]:
    """Wall seconds of one concurrent agent per client, ``turns`` turns each (clients, threads and connections are
    ready before the clock starts); per session, the prompt ids of each turn."""
    prompts: list[list[list[int]]] = [[] for _ in clients]
    ready = threading.Barrier(len(clients) + 1)

    def agent(i: int) -> None:
        messages = [{"role": "user", "content": f"What is {120 + i} times {13 + i}?"}]
        ready.wait()
        for _ in range(turns):
            prompt_ids, content = clients[i].chat(messages, max_tokens)
            prompts[i].append(prompt_ids)
            messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": "42"}]

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - start, prompts


def replay(engine: LocalGeneration, prompts: list[list[list[int]]], max_tokens: int) -> float:
    """Seconds for the engine alone: one batch per turn of every session's prompt at that turn."""
    params = SamplingParams(max_new_tokens=max_tokens, greedy=True)
    start = time.perf_counter()
    for turn in range(len(prompts[0])):
        engine.generate([p[turn] for p in prompts], params, seed=0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--client", choices=["raw", "openai"], nargs="+", default=["raw", "openai"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(MODEL)
    engine = LocalGeneration.load(MODEL, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    with RolloutServer(engine, tokenizer, ServerConfig(auto_create_sessions=True)) as server:
        for kind, turns in [(k, t) for k in args.client for t in args.turns]:
            clients = [(RawClient if kind == "raw" else OpenAIClient)(server) for _ in range(args.sessions)]
            run_sessions(clients, 1, args.max_tokens)  # warm-up: every client opens its connection
            http, direct, engine_calls = [], [], server.queue.stats.engine_calls
            for _ in range(args.repeats):
                seconds, prompts = run_sessions(clients, turns, args.max_tokens)
                http.append(seconds)
                direct.append(replay(engine, prompts, args.max_tokens))
            h, d = statistics.median(http), statistics.median(direct)
            calls = args.sessions * turns
            print(
                f"{kind:6s} client, {turns} turn(s), {args.sessions} sessions: HTTP {1000 * h / turns:.1f} ms/turn, engine {1000 * d / turns:.1f} ms/turn, "
                f"{1000 * h / calls:.2f} ms/call; overhead {100 * (h / d - 1):+.0f}% "
                f"(server engine calls per turn {(server.queue.stats.engine_calls - engine_calls) / (turns * args.repeats):.1f}, replay 1)"
            )


if __name__ == "__main__":
    main()
