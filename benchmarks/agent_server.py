"""Rollout-server overhead: seconds per turn through HTTP (the real ``openai`` client, the real server) vs the same
prompts through the engine directly, for sessions of 1 and 8 turns.

Usage: python benchmarks/agent_server.py [--sessions 8] [--turns 1 8] [--max-tokens 12] [--repeats 3]

Each of ``--sessions`` agents (threads) runs a session of T turns against the shipped tiny tool model (greedy, so a
replay samples the same tokens): call, append the answer and a tool message, call again. The HTTP time is the wall
time of all sessions together. The replay then sends, per turn, every session's recorded prompt ids of that turn as
one ``engine.generate`` batch with the same settings; its time is the engine's share. Overhead = HTTP / engine - 1
(rendering, tokenising, HTTP, JSON, batching window, recording). Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import openai
import torch

from nemo_like.models.generation.interface import SamplingParams
from nemo_like.models.loading import load_tokenizer
from nemo_like.serving import RolloutServer, ServerConfig
from nemo_like.serving.local_engine import LocalGeneration

MODEL = "embedded:tiny-tool-qwen2"


def run_sessions(server: RolloutServer, sessions: int, turns: int, max_tokens: int) -> tuple[float, list[list[list[int]]]]:
    """Wall seconds of ``sessions`` concurrent agents of ``turns`` turns; per session, the prompt ids of each turn."""
    prompts: list[list[list[int]]] = [[] for _ in range(sessions)]

    def agent(i: int) -> None:
        client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)
        messages = [{"role": "user", "content": f"What is {120 + i} times {13 + i}?"}]
        for _ in range(turns):
            reply = client.chat.completions.create(
                model="policy", messages=messages, temperature=0, max_tokens=max_tokens, extra_body={"return_token_ids": True}
            )
            prompts[i].append(reply.prompt_token_ids)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}, {"role": "tool", "content": "42"}]

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(sessions)]
    start = time.perf_counter()
    for t in threads:
        t.start()
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(MODEL)
    engine = LocalGeneration.load(MODEL, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    with RolloutServer(engine, tokenizer, ServerConfig(auto_create_sessions=True)) as server:
        run_sessions(server, 2, 1, args.max_tokens)  # warm-up
        for turns in args.turns:
            http, direct = [], []
            for _ in range(args.repeats):
                seconds, prompts = run_sessions(server, args.sessions, turns, args.max_tokens)
                http.append(seconds)
                direct.append(replay(engine, prompts, args.max_tokens))
            h, d = statistics.median(http), statistics.median(direct)
            calls = args.sessions * turns
            print(
                f"{turns} turn(s), {args.sessions} sessions: HTTP {1000 * h / turns:.1f} ms/turn, engine {1000 * d / turns:.1f} ms/turn, "
                f"{1000 * h / calls:.2f} ms/call; overhead {100 * (h / d - 1):+.0f}% "
                f"(engine calls {server.queue.stats.engine_calls}, prompts {server.queue.stats.prompts})"
            )


if __name__ == "__main__":
    main()
