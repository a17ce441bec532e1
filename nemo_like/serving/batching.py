"""Concurrent HTTP calls -> batched engine calls, one at a time.

Handlers submit their prompts (``n`` copies for ``n`` choices) and wait on a future; one thread takes everything
queued (waiting up to ``window_s`` for more after the first request), groups it by sampling settings except
``max_new_tokens``, and calls ``engine.generate`` once per group with the group's largest ``max_new_tokens`` (a request
that sets ``seed`` is a group of its own). A request's samples are then cut to its own ``max_new_tokens``: tokens are
drawn one after another, so the first k tokens of a longer draw are a draw of k tokens, logprobs included. The engine is only ever called from that thread.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from nemo_like.models.generation.interface import GeneratedSample, GenerationInterface, SamplingParams


@dataclass
class _Request:
    prompts: list[list[int]]
    params: SamplingParams
    seed: int | None
    future: Future = field(default_factory=Future)


@dataclass
class BatchStats:
    """Engine calls made and prompts sampled (how much batching the concurrent calls got)."""

    engine_calls: int = 0
    prompts: int = 0
    requests: int = 0


class GenerationQueue:
    """Owns the engine's calling thread; :meth:`submit` is safe from any thread."""

    def __init__(self, engine: GenerationInterface, seed: int = 0, max_batch: int = 64, window_s: float = 0.002) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.window_s = window_s
        self.stats = BatchStats()
        self._seeds = itertools.count(seed * 1_000_003)
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rollout-server-engine", daemon=True)
        self._thread.start()

    def submit(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> Future:
        """A future of one :class:`GeneratedSample` per prompt (``seed``: the request's own, else the queue's next)."""
        request = _Request([list(p) for p in prompts], params, seed)
        self._queue.put(request)
        return request.future

    def close(self) -> None:
        """Stop the thread once the queued requests are served."""
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _take(self) -> tuple[list[_Request], bool]:
        first = self._queue.get()
        if first is None:
            return [], True
        batch, size, deadline = [first], len(first.prompts), time.monotonic() + self.window_s
        while size < self.max_batch:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
            size += len(item.prompts)
        return batch, False

    def _run(self) -> None:
        stop = False
        while not stop:
            batch, stop = self._take()
            groups: dict[tuple, list[_Request]] = defaultdict(list)
            for request in batch:  # a request with its own seed is sampled alone (reproducible for that seed)
                key = replace(request.params, max_new_tokens=0)
                groups[(key, None if request.seed is None else id(request))].append(request)
            for (key, _), requests in groups.items():
                params = replace(key, max_new_tokens=max(r.params.max_new_tokens for r in requests))
                self._generate(requests, params, requests[0].seed)

    def _generate(self, requests: list[_Request], params: SamplingParams, seed: int | None) -> None:
        prompts = [p for r in requests for p in r.prompts]
        try:
            samples = self.engine.generate(prompts, params, next(self._seeds) if seed is None else seed)
            if len(samples) != len(prompts):
                raise RuntimeError(f"the engine returned {len(samples)} samples for {len(prompts)} prompts")
        except Exception as exc:  # every waiting handler answers 500; the thread keeps serving
            for request in requests:
                request.future.set_exception(exc)
            return
        self.stats.engine_calls += 1
        self.stats.prompts += len(prompts)
        self.stats.requests += len(requests)
        start = 0
        for request in requests:
            limit = request.params.max_new_tokens
            request.future.set_result([cut_to(s, limit) for s in samples[start : start + len(request.prompts)]])
            start += len(request.prompts)


def cut_to(sample: GeneratedSample, max_new_tokens: int) -> GeneratedSample:
    """``sample`` with at most ``max_new_tokens`` response tokens (then truncated: it hit its own limit)."""
    if len(sample.response_ids) <= max_new_tokens:
        return sample
    return replace(
        sample,
        response_ids=sample.response_ids[:max_new_tokens],
        response_logprobs=sample.response_logprobs[:max_new_tokens],
        truncated=True,
    )
