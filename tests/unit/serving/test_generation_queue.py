"""The rollout server's generation queue: seeded calls share one engine call and sample what they sample alone; the
thread waits for callers it answered (not for a lone caller, and not past its patience)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from nemo_like.models.generation.interface import GeneratedSample, SamplingParams
from nemo_like.models.loading import load_tokenizer
from nemo_like.serving.batching import GenerationQueue
from nemo_like.serving.local_engine import LocalGeneration
from nemo_like.utils.seeds import serving_seed

MODEL = "embedded:tiny-tool-qwen2"
HOT = SamplingParams(max_new_tokens=10, temperature=3.0, top_k=50, top_p=0.95)  # a flat distribution: seeds matter


class Held:
    """An engine (``engine``, or one that answers one pad token per prompt when None) whose generate calls are recorded
    and held at ``gate`` until it is set, so that requests queue up behind a running call (``entered``: one is held)."""

    def __init__(self, engine=None, per_prompt_seeds: bool = True) -> None:
        self.engine, self.calls = engine, []
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()
        self.PER_PROMPT_SEEDS = per_prompt_seeds

    def generate(self, prompts, params, seed):
        self.entered.set()
        self.gate.wait(30)
        self.calls.append((len(prompts), seed))
        if self.engine is not None:
            return self.engine.generate(prompts, params, seed)
        time.sleep(0.002)  # a call takes a little while: the patience is a multiple of it
        return [GeneratedSample(list(p), [0], [0.0], False, 0) for p in prompts]

    def hold(self, queue: GenerationQueue, *request) -> Future:
        """Submit ``request`` and return once the engine thread holds it (the next submissions queue up)."""
        self.gate.clear()
        self.entered.clear()
        future = queue.submit(*request)
        assert self.entered.wait(30)
        return future


@pytest.fixture(scope="module")
def local():
    tokenizer = load_tokenizer(MODEL)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["What is 347 times 28?", "12 * 5", "9 times 81, then add 4"]]
    return LocalGeneration.load(MODEL, tokenizer.pad_token_id, [tokenizer.eos_token_id]), prompts


def tokens(samples):
    return [s.response_ids for s in samples]


def test_concurrent_seeded_calls_share_one_engine_call_and_sample_what_they_sample_alone(local) -> None:
    engine, prompts = local
    held = Held(engine)
    queue = GenerationQueue(held, window_s=0.0)
    try:
        requests = [([prompts[0]], HOT, 11), ([prompts[1]] * 2, HOT, 22), ([prompts[2]], HOT, 33), ([prompts[0]], HOT, 44)]
        requests.append(([prompts[2]], SamplingParams(max_new_tokens=5, temperature=3.0, top_k=50, top_p=0.95), 33))
        alone = [tokens(queue.submit(*r).result(60)) for r in requests]
        assert [n for n, _ in held.calls] == [1, 2, 1, 1, 1]  # one engine call each
        held.calls.clear()
        blocker = held.hold(queue, [prompts[1]], HOT, 5)
        futures = [queue.submit(*r) for r in requests]  # queued behind the held call
        held.gate.set()
        together = [tokens(f.result(60)) for f in futures]
        blocker.result(60)
    finally:
        queue.close()
    assert together == alone  # each call's tokens, whatever it was batched with
    assert [n for n, _ in held.calls] == [1, 6]  # the held call, then every queued call in one engine call
    assert held.calls[1][1] == [11, 22, 23, 33, 44, 33]  # choice j of a call seeded s: s + j
    assert alone[1] == tokens(engine.generate([prompts[1]] * 2, HOT, [22, 23]))
    assert alone[0] != alone[3]  # the same prompt with another seed: another draw
    assert alone[4][0] == alone[2][0][:5]  # a shorter limit (at least half the call's) cuts the same draw


def test_an_engine_without_per_prompt_seeds_samples_each_seeded_call_alone(local) -> None:
    engine, prompts = local
    held = Held(engine, per_prompt_seeds=False)
    queue = GenerationQueue(held, seed=7, window_s=0.0)
    try:
        blocker = held.hold(queue, [prompts[1]], HOT)
        futures = [queue.submit([p], HOT, seed) for p, seed in zip(prompts, [1, 2, 3])] + [queue.submit([prompts[0]], HOT)]
        held.gate.set()
        for f in [blocker, *futures]:
            f.result(60)
    finally:
        queue.close()
    assert held.calls == [(1, serving_seed(7, 0)), (1, 1), (1, 2), (1, 3), (1, serving_seed(7, 1))]  # int seeds, as before
    assert queue.stats.waits == 0  # nothing to merge seeded calls into: no wait for callers


def test_consecutive_unseeded_calls_share_no_seed(local) -> None:
    """Engines seed a call's request i with its seed + i (vLLM): the queue's counter (seed, seed + 1, ...) gave call
    c + 1's first request call c's second seed, so independent n=2 requests on one prompt drew the same completion."""
    engine, prompts = local
    held = Held(engine, per_prompt_seeds=False)
    queue = GenerationQueue(held, seed=7, window_s=0.0)
    try:
        draws = [tokens(queue.submit([prompts[0]] * 2, HOT).result(60)) for _ in range(4)]
    finally:
        queue.close()
    used = [set(range(seed, seed + n)) for n, seed in held.calls]  # what a seed + i engine draws with
    assert all(not (a & b) for i, a in enumerate(used) for b in used[i + 1 :]), held.calls
    assert len({tuple(d) for draw in draws for d in draw}) == 8  # eight different completions (a flat distribution)


def test_the_thread_waits_for_the_callers_it_answered_but_never_for_a_lone_caller() -> None:
    held = Held()
    queue = GenerationQueue(held, window_s=0.0, wait_ratio=1e6, max_wait_s=30.0)  # patience: 30 s, never reached here
    params = SamplingParams(max_new_tokens=1)
    try:
        for _ in range(5):  # one caller, one call after another: it is the call expected, nothing to wait for
            queue.submit([[1]], params).result(10)
        assert queue.stats.waits == 0
        a = held.hold(queue, [[1]], params)
        b, c = queue.submit([[2]], params), queue.submit([[3]], params)  # queued behind a's call
        held.gate.set()
        a.result(10)
        time.sleep(0.05)
        assert not b.done() and not c.done()  # waiting for a's caller, answered and expected back
        calls = len(held.calls)
        rounds = [[queue.submit([[1]], params), b, c]]
        for f in rounds[0]:
            f.result(10)
        rounds.append([queue.submit([[1]], params), queue.submit([[2]], params)])
        time.sleep(0.05)
        assert not any(f.done() for f in rounds[1])  # the third caller is expected too
        rounds[1].append(queue.submit([[3]], params))
        for f in rounds[1]:
            f.result(10)
        assert [n for n, _ in held.calls[calls:]] == [3, 3] and queue.stats.waits == 2 and queue.stats.late == 0
    finally:
        queue.close()


def test_callers_that_do_not_come_back_are_waited_for_once_and_then_no_longer_expected() -> None:
    held = Held()
    queue = GenerationQueue(held, window_s=0.0, wait_ratio=1e6, max_wait_s=0.05)
    params = SamplingParams(max_new_tokens=1)
    try:
        a = held.hold(queue, [[1]], params)
        others = [queue.submit([[i]], params) for i in range(3)]
        held.gate.set()
        for f in [a, *others]:
            f.result(10)
        waits, late = queue.stats.waits, queue.stats.late
        queue.submit([[1]], params).result(10)  # two of the three callers answered last never come back: one patience
        assert (queue.stats.waits, queue.stats.late) == (waits + 1, late + 1)
        queue.submit([[1]], params).result(10)  # no longer expected: no wait
        assert (queue.stats.waits, queue.stats.late) == (waits + 1, late + 1)
    finally:
        queue.close()


def test_sessions_started_together_share_their_first_engine_call_and_an_ended_session_is_not_waited_for() -> None:
    held = Held()
    queue = GenerationQueue(held, window_s=0.0, wait_ratio=1e6, max_wait_s=30.0)  # patience: 30 s, never reached here
    params = SamplingParams(max_new_tokens=1)
    try:
        for session in "abc":  # their agents start: first calls on their way
            queue.expect(session)
        first = [queue.submit([[1]], params, None, "a"), queue.submit([[2]], params, None, "b")]
        time.sleep(0.05)
        assert not any(f.done() for f in first)  # c's first call is expected
        first.append(queue.submit([[3]], params, None, "c"))
        for f in first:
            f.result(10)
        assert [n for n, _ in held.calls] == [3]  # not [1, 2] (a batch and stragglers a call behind)
        second = [queue.submit([[1]], params, None, "a"), queue.submit([[2]], params, None, "b")]
        time.sleep(0.05)
        assert not any(f.done() for f in second)  # c was answered: expected back
        queue.forget("c")  # c's session ended instead
        for f in second:
            f.result(10)
        assert [n for n, _ in held.calls] == [3, 2] and queue.stats.late == 0
    finally:
        queue.close()


def test_a_request_given_up_before_its_engine_call_is_not_sampled() -> None:
    """A handler cancelled while its request waits (the client gone, the server stopping) cancels the request's
    future: the engine thread drops it instead of sampling it. Once its engine call has started the future is running
    and cannot be cancelled (answering a cancelled future had raised InvalidStateError in the engine thread, ending it),
    and the thread goes on serving."""
    held = Held()
    queue = GenerationQueue(held, window_s=0.0, wait_ratio=1e6, max_wait_s=0.05)
    params = SamplingParams(max_new_tokens=1)
    try:
        running = held.hold(queue, [[1]], params)
        assert not running.cancel() and running.running()
        given_up = queue.submit([[2], [2]], params)  # queued behind it, then given up
        assert given_up.cancel()
        held.gate.set()
        assert running.result(10)[0].prompt_ids == [1]
        assert queue.submit([[3]], params).result(10)[0].prompt_ids == [3]  # the thread still serves
        assert [n for n, _ in held.calls] == [1, 1] and queue.stats.cancelled == 1  # the two prompts given up: never sampled
    finally:
        queue.close()


def test_a_request_given_up_while_another_groups_call_runs_is_not_sampled() -> None:
    """Two requests taken in one batch but sampled in two engine calls (other settings): the second, given up while
    the first's call ran, had been marked running with the batch and was sampled anyway."""
    held = Held()
    queue = GenerationQueue(held, window_s=0.05, wait_ratio=0.0, max_wait_s=0.0)
    try:
        held.gate.clear()
        first = queue.submit([[1]], SamplingParams(max_new_tokens=1, temperature=1.0))
        second = queue.submit([[2]], SamplingParams(max_new_tokens=1, temperature=0.7))  # the same batch, its own group
        assert held.entered.wait(30)
        assert second.cancel()  # its engine call has not started
        held.gate.set()
        assert first.result(10)[0].prompt_ids == [1]
        assert queue.submit([[3]], SamplingParams(max_new_tokens=1)).result(10)[0].prompt_ids == [3]
        assert [n for n, _ in held.calls] == [1, 1] and queue.stats.cancelled == 1  # [2] was never sampled
    finally:
        queue.close()


def test_an_engine_call_holds_at_most_max_batch_prompts_unless_one_request_alone_is_larger() -> None:
    """Requests join a batch while it stays within ``max_batch`` prompts (the size was checked before adding the next
    request: two queued 3-prompt requests went out as one 6-prompt call with ``max_batch=4``); a request larger than
    ``max_batch`` still goes, alone."""
    held = Held()
    queue = GenerationQueue(held, max_batch=4, window_s=0.0)
    params = SamplingParams(max_new_tokens=1)
    try:
        blocker = held.hold(queue, [[0]], params)
        futures = [queue.submit(p, params) for p in ([[1], [2], [3]], [[4], [5], [6]], [[7]] * 5, [[8]])]
        held.gate.set()
        answers = [[s.prompt_ids for s in f.result(10)] for f in [blocker, *futures]]
    finally:
        queue.close()
    assert [n for n, _ in held.calls] == [1, 3, 3, 5, 1]
    assert answers == [[[0]], [[1], [2], [3]], [[4], [5], [6]], [[7]] * 5, [[8]]]


def test_a_request_after_the_queue_closed_fails_at_once() -> None:
    """A handler that outlived the server's stop submitted to a closed queue, whose thread had ended: its future
    never resolved and the handler hung."""
    queue = GenerationQueue(Held(), window_s=0.0)
    assert queue.submit([[1]], SamplingParams(max_new_tokens=1)).result(10)[0].prompt_ids == [1]
    queue.close()
    late = queue.submit([[2]], SamplingParams(max_new_tokens=1))
    with pytest.raises(RuntimeError, match="queue is closed"):
        late.result(5)


def test_the_local_engine_refuses_a_refit_whose_names_do_not_match_and_keeps_its_version() -> None:
    """strict=False loaded nothing for renamed weights (a DDP 'module.' prefix) and still took the new version."""
    from nemo_like.models.refit.manifest import RefitManifestError

    engine = LocalGeneration.load(MODEL, 0, [2])
    state = engine.model.state_dict()
    renamed = {f"module.{k}": torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(RefitManifestError, match="the local engine's parameters"):
        engine.refit(renamed, 7)
    assert engine.weight_version == 0 and all(torch.equal(v, state[k]) for k, v in engine.model.state_dict().items())
    engine.refit({k: v.clone() for k, v in state.items()}, 7)
    assert engine.weight_version == 7


def test_a_vanishing_temperature_samples_greedily() -> None:
    """temperature=1e-38 divided the logits to inf: NaN logprobs, a 500 or a rejected session; as vLLM, below 1e-5 is greedy."""
    from nemo_like.serving.protocol import ChatCompletionRequest

    def params(temperature: float):
        return ChatCompletionRequest(model="policy", messages=[{"role": "user", "content": "x"}], temperature=temperature).sampling_params(
            8
        )

    assert params(1e-38).greedy and params(0.0).greedy and params(1e-38).temperature == 1.0
    assert not params(1e-4).greedy and params(1e-4).temperature == 1e-4


def test_a_call_spans_no_more_than_the_context_nor_twice_a_requests_limit() -> None:
    """The engine samples every row of a call to the call's largest ``max_new_tokens``, over the longest prompt's width:
    a 4-token request with a 70-token prompt beside a 70-token request with a 3-token prompt was sampled to 70 tokens,
    its KV cache 140 positions (a server context of 80; vLLM refuses such a request, and the whole call with it). A
    request joins a call only while the call's span stays within the context or its longest request alone."""
    from nemo_like.serving.batching import _Request, engine_calls

    def request(width: int, limit: int) -> _Request:
        return _Request([[1] * width], SamplingParams(max_new_tokens=limit), None)

    def shape(calls):
        return [[(len(r.prompts[0]), r.params.max_new_tokens) for r in call] for call in calls]

    long_small, short_large = request(70, 4), request(3, 70)
    assert shape(engine_calls([long_small, short_large])) == [[(3, 70)], [(70, 4)]]
    assert shape(engine_calls([long_small, short_large], max_span=80)) == [[(3, 70)], [(70, 4)]]
    # half the call's limit still joins, less does not (the call decodes until every row stops: a 2-token request kept a
    # 512-token call's rows decoding); a wider prompt with a smaller limit joins within the context; order is kept
    group = [request(10, 16), request(10, 8), request(11, 16), request(10, 2), request(12, 8)]
    assert shape(engine_calls(group)) == [[(10, 16), (10, 8), (11, 16)], [(12, 8)], [(10, 2)]]
    assert shape(engine_calls(group, max_span=28)) == [[(10, 16), (10, 8), (11, 16), (12, 8)], [(10, 2)]]
    held = Held()
    queue = GenerationQueue(held, window_s=0.05, wait_ratio=0.0, max_wait_s=0.0)
    try:
        held.gate.clear()
        futures = [queue.submit(r.prompts, r.params) for r in (long_small, short_large)]
        assert held.entered.wait(30)
        held.gate.set()
        assert [len(f.result(10)) for f in futures] == [1, 1] and [n for n, _ in held.calls] == [1, 1]
    finally:
        queue.close()
