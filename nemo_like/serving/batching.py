"""Concurrent HTTP calls -> batched engine calls, one at a time.

Handlers submit their prompts (``n`` copies for ``n`` choices) and wait on a future; one thread takes everything
queued, groups it by sampling settings except ``max_new_tokens``, and calls ``engine.generate`` once per group with the
group's largest ``max_new_tokens`` (:func:`engine_calls` splits a group where that limit is more than twice a request's
own, or the longest prompt plus it would pass the context: a 4-token call with a near-full context beside a 70-token
one had been sampled to 70 tokens, past it). A request's samples are then cut to its own
``max_new_tokens``: tokens are drawn one after another, so the first k tokens of a longer draw are a draw of k tokens,
logprobs included. The engine is only ever called from that thread.

Seeds. A request with its own ``seed`` (a seeded session's call, or the request's ``seed`` field) samples the same
tokens whatever it is batched with: with an engine that takes one seed per prompt (``PER_PROMPT_SEEDS``, see
:class:`~nemo_like.models.generation.interface.GenerationInterface`), choice ``j`` of it is seeded
``chunk_seed(seed, j)`` inside the shared batch (choice 0 of a request is sampled as that request alone with
``seed``); another engine samples it alone, with ``seed``. Requests without a seed take the queue's running seed (one
int per engine call; in a batch with seeded requests, one seed per prompt).

When to call. The thread calls the engine as soon as a request waits, unless more calls are known to be on their way:
callers answered by an earlier engine call that have not called again (an agent's next turn follows its answer within
milliseconds), and agents just started (:meth:`GenerationQueue.expect`: their first call is on its way, so a batch of
sessions starting together is sampled in one engine call, not split by arrival into a batch and a straggler that then
lags one call behind to the end). A caller is its session (``caller``), identified, so a session that ends is no longer
waited for (:meth:`GenerationQueue.forget`); calls without a session are counted, not identified. Then it waits for them, at most ``wait_ratio`` times the recent engine
call's duration and never more than ``max_wait_s``: a small model's engine call costs about the same for 1 or 8 rows,
so a wait shorter than a call saves a call (before the first call, ``max_wait_s``). Callers that have not come back when that wait ends (a slow tool, an
ended session) are no longer expected. A lone caller never waits: its next call is the one expected. Nor do seeded
calls to an engine without per-prompt seeds (they are sampled one by one anyway). ``window_s``: an extra fixed wait
after the first request, for everyone (the server's default is 0).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict, deque
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from nemo_like.models.generation.interface import GeneratedSample, GenerationInterface, SamplingParams, Seeds, prompt_seeds
from nemo_like.utils.seeds import serving_seed


@dataclass
class _Request:
    prompts: list[list[int]]
    params: SamplingParams
    seed: int | None
    caller: Hashable | None = None
    future: Future = field(default_factory=Future)


@dataclass
class BatchStats:
    """Engine calls made and prompts sampled (how much batching the concurrent calls got), the waits for callers
    expected back (``waits``: batches that waited; ``waited_s``: their seconds in all; ``late``: waits that ended
    with some expected callers not back), and the requests dropped unsampled because their caller had given up
    (``cancelled``: a client that left, :func:`~nemo_like.serving.app.unless_client_leaves`)."""

    engine_calls: int = 0
    prompts: int = 0
    requests: int = 0
    waits: int = 0
    waited_s: float = 0.0
    late: int = 0
    cancelled: int = 0


class GenerationQueue:
    """Owns the engine's calling thread; :meth:`submit` is safe from any thread."""

    def __init__(
        self,
        engine: GenerationInterface,
        seed: int = 0,
        max_batch: int = 64,
        window_s: float = 0.002,
        wait_ratio: float = 0.5,
        max_wait_s: float = 0.05,
        max_span: int = 0,
    ) -> None:
        self.engine = engine
        self.max_span = max_span  # positions (prompt + completion) an engine call may span: the server's context
        self.max_batch = max_batch
        self.window_s = window_s
        self.wait_ratio = wait_ratio
        self.max_wait_s = max_wait_s
        self.per_prompt_seeds = bool(getattr(engine, "PER_PROMPT_SEEDS", False))
        self.stats = BatchStats()
        self._seed, self._calls = seed, itertools.count()  # unseeded calls: serving_seed(seed, call index)
        self._cond = threading.Condition()
        self._pending: deque[_Request | None] = deque()  # None: close
        self._pending_prompts = 0
        self._closed = False
        self._expected_callers: set[Hashable] = set()  # sessions answered or started that have not called (again)
        self._expected_anonymous = 0  # the same, for calls without a session
        self._in_flight: dict[Hashable, int] = defaultdict(int)  # each caller's requests submitted and not answered
        self._forgotten: set[Hashable] = set()  # callers forgotten while a request of theirs is in flight
        self._wake_on = "any"  # what wakes the engine thread: "any" arrival, only the "last" expected one, or "full"
        self._engine_s = 0.0  # recent engine call seconds (moving average)
        self._thread = threading.Thread(target=self._run, name="rollout-server-engine", daemon=True)
        self._thread.start()

    def submit(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None, caller: Hashable | None = None) -> Future:
        """A future of one :class:`GeneratedSample` per prompt (``seed``: the request's own, else the queue's next;
        ``caller``: the session calling, None for a call without one). Cancelling the future before its engine call
        starts drops the request (it is not sampled); once started, the future can no longer be cancelled."""
        request = _Request([list(p) for p in prompts], params, seed, caller)
        with self._cond:
            if self._closed:  # a handler that outlived the server's stop: nothing would ever serve it
                request.future.set_exception(RuntimeError("the generation queue is closed (the server is stopping)"))
                return request.future
            if caller is None:
                self._expected_anonymous = max(0, self._expected_anonymous - 1)
            else:
                self._expected_callers.discard(caller)
                self._in_flight[caller] += 1
            self._pending.append(request)
            self._pending_prompts += len(request.prompts)
            full = self._pending_prompts >= self.max_batch
            # While the thread waits for expected callers, only the last of them (or a full batch) wakes it: each
            # wake-up is a thread switch, which costs as much as the rest of a small call on a busy CPU.
            if self._wake_on == "any" or full or self._last_expected_came():
                self._cond.notify()
        return request.future

    def expect(self, caller: Hashable) -> None:
        """``caller`` (a session whose agent starts now) will call soon: a batch waits for it as for an answered one."""
        with self._cond:
            self._expected_callers.add(caller)

    def forget(self, caller: Hashable) -> None:
        """``caller`` will not call again (its session ended): a batch waiting for it stops waiting, and the answer to a
        request of it in flight does not make it expected again (the next batch waited its whole patience for it)."""
        with self._cond:
            if self._in_flight.get(caller):
                self._forgotten.add(caller)
            if caller in self._expected_callers:
                self._expected_callers.discard(caller)
                if self._last_expected_came():
                    self._cond.notify()

    def _answered(self, caller: Hashable | None) -> bool:
        """A request of ``caller`` is answered or dropped (with the lock held); whether ``caller`` may still call
        (False: it was forgotten, :meth:`forget`)."""
        if caller is None:
            return True
        left = self._in_flight[caller] - 1
        if left > 0:
            self._in_flight[caller] = left
            return caller not in self._forgotten
        self._in_flight.pop(caller, None)
        if caller in self._forgotten:
            self._forgotten.discard(caller)
            return False
        return True

    def _expected(self) -> int:
        return len(self._expected_callers) + self._expected_anonymous

    def _last_expected_came(self) -> bool:
        """The thread waits for expected callers and none is left (called with the lock held)."""
        return self._wake_on == "last" and not self._expected()

    def close(self) -> None:
        """Stop the thread once the queued requests are served."""
        with self._cond:
            self._closed = True
            self._pending.append(None)
            self._cond.notify()
        self._thread.join(timeout=60)

    def _take(self) -> tuple[list[_Request], bool]:
        with self._cond:
            while not self._pending:
                self._wake_on = "any"
                self._cond.wait()
            start = time.monotonic()
            patience = min(self.max_wait_s, self.wait_ratio * self._engine_s) if self.stats.engine_calls else self.max_wait_s
            window_end, patience_end = start + self.window_s, start + patience
            waited = False
            # Waiting can only merge calls the engine can sample together: not seeded ones without per-prompt seeds.
            mergeable = self.per_prompt_seeds or self._pending[0] is None or self._pending[0].seed is None
            while self._pending_prompts < self.max_batch and None not in self._pending:
                expecting = mergeable and self._expected() > 0
                now, deadline = time.monotonic(), max(window_end, patience_end) if expecting else window_end
                if now >= deadline:
                    if expecting:  # the callers still expected are slow (a tool, an ended session): stop waiting for them
                        self._expected_callers.clear()
                        self._expected_anonymous = 0
                        self.stats.late += 1
                    break
                waited |= expecting
                self._wake_on = "last" if expecting else "full"
                self._cond.wait(deadline - now)
            self._wake_on = "any"
            batch: list[_Request] = []
            size = 0
            # A request joins while the batch stays within max_batch prompts; one larger than max_batch goes alone
            while self._pending and self._pending[0] is not None and (not batch or size + len(self._pending[0].prompts) <= self.max_batch):
                request = self._pending.popleft()
                batch.append(request)
                size += len(request.prompts)
            self._pending_prompts -= size
            stop = bool(self._pending) and self._pending[0] is None
        if waited:
            self.stats.waits += 1
            self.stats.waited_s += time.monotonic() - start
        return batch, stop

    def _run(self) -> None:
        stop = False
        while not stop:
            batch, stop = self._take()
            if not batch:
                continue
            groups: dict[tuple, list[_Request]] = defaultdict(list)
            for request in batch:  # without per-prompt seeds, a seeded request is sampled alone (its seed as the batch's)
                key = replace(request.params, max_new_tokens=0)
                alone = request.seed is not None and not self.per_prompt_seeds
                groups[(key, id(request) if alone else None)].append(request)
            for (key, _), group in groups.items():
                for call in engine_calls(group, self.max_span):
                    # Each call's requests start just before it: one given up while another call ran is dropped too
                    # (False: its caller gave up)
                    requests = [r for r in call if r.future.set_running_or_notify_cancel()]
                    self.stats.cancelled += len(call) - len(requests)
                    if len(requests) < len(call):
                        with self._cond:
                            for request in call:
                                if request.future.cancelled():
                                    self._answered(request.caller)
                    if not requests:
                        continue
                    params = replace(key, max_new_tokens=max(r.params.max_new_tokens for r in requests))
                    self._generate(requests, params, self._batch_seed(requests))

    def _batch_seed(self, requests: list[_Request]) -> Seeds:
        """The engine call's seed: the queue's next for unseeded requests; a seeded request alone, its own; else one
        seed per prompt (a seeded request's choice j: ``chunk_seed(seed, j)``; an unseeded prompt: the queue's next)."""
        if all(r.seed is None for r in requests):
            return self._next_seed()
        if not self.per_prompt_seeds:
            return requests[0].seed  # grouped alone (_run)
        seeds: list[int] = []
        for r in requests:
            seeds.extend(prompt_seeds(r.seed, len(r.prompts)) if r.seed is not None else [self._next_seed() for _ in r.prompts])
        return seeds

    def _next_seed(self) -> int:
        return serving_seed(self._seed, next(self._calls))

    def _generate(self, requests: list[_Request], params: SamplingParams, seed: Seeds) -> None:
        prompts = [p for r in requests for p in r.prompts]
        start = time.monotonic()
        try:
            samples = self.engine.generate(prompts, params, seed)
            if len(samples) != len(prompts):
                raise RuntimeError(f"the engine returned {len(samples)} samples for {len(prompts)} prompts")
        except Exception as exc:  # every waiting handler answers 500; the thread keeps serving
            with self._cond:
                for request in requests:
                    self._answered(request.caller)
            for request in requests:
                request.future.set_exception(exc)
            return
        seconds = time.monotonic() - start
        self._engine_s = seconds if not self.stats.engine_calls else 0.5 * (self._engine_s + seconds)
        self.stats.engine_calls += 1
        self.stats.prompts += len(prompts)
        self.stats.requests += len(requests)
        with self._cond:  # before the answers: a caller may call again before this thread runs another line
            for request in requests:
                if request.caller is None:
                    self._expected_anonymous += 1
                elif self._answered(request.caller):  # not a session that ended meanwhile: it will not call again
                    self._expected_callers.add(request.caller)
        at = 0
        for request in requests:
            limit = request.params.max_new_tokens
            request.future.set_result([cut_to(s, limit) for s in samples[at : at + len(request.prompts)]])
            at += len(request.prompts)


#: A request shares an engine call whose token limit is at most this many times its own: the engine samples every row
#: to the call's limit and stops when every row has stopped, so a 2-token request beside a 512-token one whose rows
#: stop at 20 kept the whole call decoding 512 steps (an extra call costs a call: limits close to each other share one).
MAX_LIMIT_RATIO = 2


def engine_calls(group: list[_Request], max_span: int = 0) -> list[list[_Request]]:
    """``group`` (one sampling setting) split into engine calls, each sampled to its largest ``max_new_tokens``: a
    request joins a call whose limit is at most :data:`MAX_LIMIT_RATIO` times its own, and only while the call's
    left-padded span (longest prompt + that limit: every row's KV cache, and the positions its rows reach) stays within
    ``max_span`` (the server's context) or the longest span one of its requests has alone (a vLLM engine refuses a
    request past its context, the whole call with it). Largest limits first; requests keep their order within a call."""
    calls: list[_Call] = []
    for request in sorted(group, key=lambda r: -r.params.max_new_tokens):
        limit = request.params.max_new_tokens
        width = max(len(p) for p in request.prompts)
        for call in calls:  # call.limit is the call's largest: calls are filled largest first
            alone = max(call.longest_alone, width + limit)
            if call.limit <= MAX_LIMIT_RATIO * limit and max(width, call.width) + call.limit <= max(alone, max_span):
                call.requests.append(request)
                call.width, call.longest_alone = max(call.width, width), alone
                break
        else:
            calls.append(_Call([request], limit, width, width + limit))
    position = {id(r): i for i, r in enumerate(group)}
    return [sorted(call.requests, key=lambda r: position[id(r)]) for call in calls]


@dataclass
class _Call:
    """An engine call being filled by :func:`engine_calls`: its requests, its token limit (its first request's, the
    largest), its longest prompt and the longest span (prompt + limit) one of its requests has alone."""

    requests: list[_Request]
    limit: int
    width: int
    longest_alone: int


def cut_to(sample: GeneratedSample, max_new_tokens: int) -> GeneratedSample:
    """``sample`` with at most ``max_new_tokens`` response tokens (then truncated: it hit its own limit); the engine's
    tokens past the cut still count as decoded (``performance/num_generated_tokens``)."""
    if len(sample.response_ids) <= max_new_tokens:
        return sample
    return replace(
        sample,
        response_ids=sample.response_ids[:max_new_tokens],
        response_logprobs=sample.response_logprobs[:max_new_tokens],
        truncated=True,
        final_weight_version=sample.kept_version(max_new_tokens),
        decoded_tokens=sample.num_decoded_tokens,
    )
