"""The rollout server's cost per call as a session grows: milliseconds per call at turns 1-8, 57-64, 121-128 and
249-256 of one session, through HTTP (the stdlib client), against an engine that answers at once (a canned four-token
completion), so what is timed is the client, HTTP and the server, none of the sampling.

Usage: python benchmarks/long_sessions.py [--turns 256] [--repeats 3]

An agent sends its whole history at every call (OpenAI's protocol), so some cost per call grows with the turns
whatever the server does: the client's JSON, the body's parsing and validation, the chat template's rendering. The
server used to normalise every message for the template at every call as well; it now keeps the last call's
normalised messages per session (``Continuations.normalized``). Both are timed side by side in one run, alternating
per repeat: ``reuse`` (the server as it is) and ``every call`` (the same server with every message normalised at every
call). Each figure is the median over the repeats of a bucket's median.
"""

from __future__ import annotations

import argparse
import statistics
import time

from agent_server import MODEL, StdlibClient

from nemo_like.models.generation.interface import GeneratedSample
from nemo_like.models.loading import load_tokenizer
from nemo_like.serving import RolloutServer, ServerConfig
from nemo_like.serving.continuation import Continuations

BUCKETS = [(0, 8), (56, 64), (120, 128), (248, 256)]


class AnswersAtOnce:
    """An engine that returns the same four tokens (the last one the end of turn) for every prompt, at once."""

    PER_PROMPT_SEEDS = True
    weight_version = 0

    def __init__(self, end_of_turn: int) -> None:
        self.completion = [40, 41, 42, end_of_turn]

    def generate(self, prompts: list[list[int]], params, seed) -> list[GeneratedSample]:
        return [
            GeneratedSample(
                prompt_ids=list(p), response_ids=list(self.completion), response_logprobs=[-0.1] * 4, truncated=False, weight_version=0
            )
            for p in prompts
        ]

    def shutdown(self) -> None:
        pass


def normalize_every_message(self: Continuations, messages, normalize) -> list[dict]:
    """The server before it kept a session's normalised messages: every message, every call."""
    messages = list(messages)
    digests = Continuations._digests(messages, [""], 0)  # every history digest from scratch too
    return [normalize(message, index, digests[index])[0] for index, message in enumerate(messages)]


def one_session(server: RolloutServer, client: StdlibClient, turns: int, seed: int) -> list[float]:
    """Seconds of each call of one session of ``turns`` calls (call, append the answer and a tool message, call again)."""
    client.use_session(server.sessions.open(metadata={"seed": seed}))
    messages = [{"role": "user", "content": "What is 120 times 13?"}]
    seconds = []
    for _ in range(turns):
        start = time.perf_counter()
        _, _, content = client.chat(messages, 12, 1.0)
        seconds.append(time.perf_counter() - start)
        messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": "42"}]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_tokenizer(MODEL)
    reuse = Continuations.normalized
    modes = {"reuse": reuse, "every call": normalize_every_message}
    buckets = [(a, b) for a, b in BUCKETS if b <= args.turns]
    results: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    config = ServerConfig(auto_create_sessions=True, max_context=10**7)
    with RolloutServer(AnswersAtOnce(tokenizer.eos_token_id), tokenizer, config) as server:
        client = StdlibClient(server)
        one_session(server, client, 8, seed=0)  # warm-up: the connection, the template
        try:
            for repeat in range(args.repeats):
                for mode in modes if repeat % 2 == 0 else reversed(list(modes)):
                    Continuations.normalized = modes[mode]
                    seconds = one_session(server, client, args.turns, seed=repeat + 1)
                    results[mode].append([statistics.median(seconds[a:b]) * 1000 for a, b in buckets])
        finally:
            Continuations.normalized = reuse
    header = "".join(f"{f'turns {a + 1}-{b}':>16s}" for a, b in buckets)
    print(f"{'ms per call':14s}{header}")
    medians = {mode: [statistics.median(r[i] for r in runs) for i in range(len(buckets))] for mode, runs in results.items()}
    for mode, values in medians.items():
        print(f"{mode:14s}" + "".join(f"{v:16.2f}" for v in values))
    print(f"{'ratio':14s}" + "".join(f"{e / r:16.2f}" for r, e in zip(medians["reuse"], medians["every call"])))


if __name__ == "__main__":
    main()
