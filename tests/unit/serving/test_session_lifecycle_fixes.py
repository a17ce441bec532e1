"""A session's life on the rollout server, against the real server (the real ``openai`` client and httpx) over the
shipped tokenizer and an engine whose tokens show each prompt's seed: a seeded session's concurrent calls sample the
same on a rerun whatever order they arrive in; a call whose client left keeps its budget reservation while the engine
still samples it; sessions opened with ``POST /v1/sessions`` are bounded like those a call opens, and ending them for
room does not stall the event loop; the generation queue does not wait for a session that ended while its call ran."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import httpx
import openai
import pytest

from nemo_like.models.generation.interface import GeneratedSample, SamplingParams, Seeds, prompt_seeds
from nemo_like.models.loading import load_tokenizer
from nemo_like.serving.batching import GenerationQueue
from nemo_like.serving.server import RolloutServer, ServerConfig
from nemo_like.serving.sessions import BUDGET_KEY, SEED_KEY, SessionStore

TOKENIZER = load_tokenizer("embedded:tiny-tool-qwen2")
EOS = TOKENIZER.eos_token_id


class SeedShowing:
    """An engine whose completion of a prompt is drawn from that prompt's own seed (so equal seeds, equal tokens);
    ``gate``: each call waits for it after setting ``entered``. ``sampled``: the tokens it has sampled in all."""

    PER_PROMPT_SEEDS = True

    def __init__(self) -> None:
        self.weight_version = 0
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()
        self.sampled = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: Seeds) -> list[GeneratedSample]:
        self.entered.set()
        assert self.gate.wait(30)
        samples = []
        for prompt, prompt_seed in zip(prompts, prompt_seeds(seed, len(prompts))):
            rng = random.Random(prompt_seed)
            ids = [100 + rng.randrange(1000) for _ in range(params.max_new_tokens)]
            self.sampled += len(ids)
            samples.append(GeneratedSample(list(prompt), ids, [-0.5] * len(ids), True, 0, 0))
        return samples

    def hold(self) -> None:
        """Hold the next engine call at the gate (``entered`` is set once it waits there)."""
        self.gate.clear()
        self.entered.clear()


def client(server: RolloutServer, session_id: str, timeout: float | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.base_url, api_key=server.api_key, default_headers={"X-Session-Id": session_id}, max_retries=0, timeout=timeout
    )


def ask(server: RolloutServer, session_id: str, question: str, timeout: float | None = None) -> list[int]:
    reply = client(server, session_id, timeout).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": question}], max_tokens=4, extra_body={"return_token_ids": True}
    )
    return reply.choices[0].model_extra["completion_token_ids"]


def wait_for(condition: Callable[[], bool], tries: int = 1000) -> None:
    """Poll ``condition`` every 20 ms until it holds (failing after ``tries`` polls)."""
    pause = threading.Event()
    for _ in range(tries):
        if condition():
            return
        pause.wait(0.02)
    pytest.fail("the condition never held")


def seed_showing_server(**config: object) -> RolloutServer:
    """A server over a :class:`SeedShowing` engine."""
    return RolloutServer(SeedShowing(), TOKENIZER, ServerConfig(max_context=256, **config), [EOS])


def concurrent_rerun(order: tuple[str, str]) -> dict[str, list[int]]:
    """A fresh server; one session seeded 1234 asks both questions at once, the first of ``order`` reaching the
    server (and the engine) before the second. Each question's completion."""
    engine = SeedShowing()
    with RolloutServer(engine, TOKENIZER, ServerConfig(max_context=256), [EOS]) as server:
        session_id = server.sessions.open(metadata={SEED_KEY: 1234})
        answers: dict[str, list[int]] = {}

        def run(question: str) -> None:
            answers[question] = ask(server, session_id, question)

        engine.hold()
        first = threading.Thread(target=run, args=(order[0],))
        first.start()
        assert engine.entered.wait(30)  # the first call is sampling: the second arrives after it
        second = threading.Thread(target=run, args=(order[1],))
        second.start()
        wait_for(lambda: server.sessions.session(session_id).num_http_calls == 2)
        engine.gate.set()
        first.join(30)
        second.join(30)
        # A sequential agent's next calls: the same prompt twice draws two different samples
        answers["again 1"], answers["again 2"] = ask(server, session_id, "again"), ask(server, session_id, "again")
        server.sessions.end(session_id)
    return answers


def test_a_seeded_sessions_concurrent_calls_sample_the_same_whichever_arrives_first() -> None:
    """Call k in arrival order took seed k: an agent's ``asyncio.gather`` of two calls swapped their seeds whenever the
    requests raced the other way, so a deterministic agent did not rerun identically."""
    a_first = concurrent_rerun(("question A", "question B"))
    b_first = concurrent_rerun(("question B", "question A"))
    assert a_first == b_first
    assert a_first["question A"] != a_first["question B"]
    assert a_first["again 1"] != a_first["again 2"]  # a repeated prompt is the session's next sample of it, not the same


def test_a_call_abandoned_while_sampled_keeps_its_budget_until_the_engine_is_done() -> None:
    """A call whose client timed out while the engine sampled it gave its reservation back at once: the client's retry
    reserved the whole budget again while the abandoned call still sampled it (several budgets for one session)."""
    engine = SeedShowing()
    with RolloutServer(engine, TOKENIZER, ServerConfig(max_context=256), [EOS]) as server:
        session_id = server.sessions.open(metadata={BUDGET_KEY: 4})
        session = server.sessions.session(session_id)
        engine.hold()
        try:
            with pytest.raises(openai.APITimeoutError):
                ask(server, session_id, "hi", timeout=0.5)
            assert engine.entered.is_set()  # its engine call started before the client left
            wait_for(lambda: session.abandoned_calls == 1)
            assert session.reserved_tokens == 4  # the engine still samples its 4 tokens
            with pytest.raises(openai.BadRequestError, match="4 more reserved by its calls in flight"):
                ask(server, session_id, "hi")  # the retry: the budget is still held
        finally:
            engine.gate.set()
        wait_for(lambda: session.reserved_tokens == 0)  # the engine call ended: the tokens were never recorded
        assert len(ask(server, session_id, "hi")) == 4
        assert engine.sampled == 8 and session.sampled_tokens == 4
        server.sessions.end(session_id)


def test_sessions_opened_explicitly_are_bounded_like_those_a_call_opens() -> None:
    """``nemo-like serve`` (``max_kept_results``) bounded only the sessions a call auto-created: an agent that opened
    its sessions with ``POST /v1/sessions`` and never ended them grew the store forever."""
    store = SessionStore(max_kept_results=2)
    for session_id in ("a", "b", "c"):
        store.open(session_id)
    assert store.open_ids() == ["b", "c"]  # "a", the least recently used, ended
    busy, _ = store.begin_call("b")  # a session with a call in flight is never the one ended
    store.open("d")
    assert store.open_ids() == ["b", "d"]
    store.end_call(busy)
    assert [r.session_id for r in store.take_finished()] == ["a", "c"]
    with seed_showing_server(max_kept_results=2) as server:
        headers = {"Authorization": f"Bearer {server.api_key}"}
        opened = [httpx.post(f"{server.base_url}/sessions", json={}, headers=headers, timeout=30).json()["id"] for _ in range(5)]
        for session_id in opened[-2:]:
            ask(server, session_id, "hi")
        assert server.sessions.open_ids() == opened[-2:]
        with pytest.raises(openai.ConflictError):  # ended for room: a late call is a 409, not a new session
            ask(server, opened[0], "hi")


def test_ending_a_session_for_room_does_not_hold_up_other_requests() -> None:
    """The call that opened a session past the cap ended the least recently used one on the event loop, building its
    rows there: every other request (even ``GET /v1/models``) waited for it."""
    with seed_showing_server(max_kept_results=1) as server:
        ask(server, "old", "hi")
        ending, release = threading.Event(), threading.Event()
        forget = server.sessions.on_end

        def slow_end(session_id: str) -> None:  # ending "old" (for room) takes until released
            ending.set()
            assert release.wait(30)
            forget(session_id)

        server.sessions.on_end = slow_end
        new = threading.Thread(target=ask, args=(server, "new", "hi"))
        new.start()
        try:
            assert ending.wait(30)
            models = httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=10)
            assert models.status_code == 200  # served while "old" is still being ended
        finally:
            release.set()
            new.join(30)
        assert server.sessions.open_ids() == ["new"]
        assert server.sessions.take_result("old").num_calls == 1


def test_a_session_ended_while_its_call_is_sampled_is_not_waited_for_afterwards() -> None:
    """A session ended (``forget``) while its call was in the engine became an expected caller again when that call was
    answered: the next engine call of the other sessions waited its whole patience for it (and counted as late)."""
    engine = SeedShowing()
    queue = GenerationQueue(engine, max_wait_s=2.0, wait_ratio=1e6, window_s=0.0)
    try:
        engine.hold()
        ended = queue.submit([[1, 2]], SamplingParams(max_new_tokens=2), 1, "ended")
        assert engine.entered.wait(30)
        queue.forget("ended")  # its session ended while the call is sampled
        engine.gate.set()
        ended.result(30)
        queue.submit([[3, 4]], SamplingParams(max_new_tokens=2), 2, "alive").result(30)
        assert (queue.stats.waits, queue.stats.late, queue.stats.engine_calls) == (0, 0, 2)
    finally:
        queue.close()


def test_a_session_used_while_earlier_ones_end_for_room_is_kept() -> None:
    """make_room took the whole list of sessions to end up front: a session chosen as least recently used that had a
    whole call while an earlier one was being ended was ended anyway (its agent's next call a 409)."""
    store = SessionStore(max_kept_results=2)
    store.open("x")
    store.open("a")
    store.open("n1", make_room=False)  # as POST /v1/sessions does: chooses x
    store.open("n2", make_room=False)  # chooses a

    def on_end(session_id: str) -> None:
        if session_id == "x":  # the worker thread ends x while the event loop serves a whole call of a
            session, _ = store.begin_call("a", make_room=False)
            store.end_call(session)

    store.on_end = on_end
    store.make_room()
    assert store.open_ids() == ["n1", "n2", "a"]
    store.begin_call("a")


def test_a_calls_seed_counts_calls_with_the_same_prompt_and_settings() -> None:
    """Calls with one prompt but other settings (temperature) are not interchangeable: counted apart, each takes its
    own seed whichever arrives first (they swapped seeds with their arrival order), and never the other's (the same
    seed would replay the other's first tokens)."""
    first, second = SessionStore(), SessionStore()
    for store in (first, second):
        store.open("s", {SEED_KEY: 3})
    one = first.session("s")
    short_first = [first.call_seed(one, [5, 6], "temperature=0.7"), first.call_seed(one, [5, 6], "temperature=1.0")]
    two = second.session("s")
    long_first = [second.call_seed(two, [5, 6], "temperature=1.0"), second.call_seed(two, [5, 6], "temperature=0.7")]
    assert short_first == long_first[::-1] and short_first[0] != short_first[1]
    assert first.call_seed(one, [5, 6], "temperature=0.7") != short_first[0]  # the same prompt and settings again: repeat 1


def test_a_calls_seed_follows_its_asked_max_tokens_not_the_budgets_cut() -> None:
    """The seed's settings are the call's as asked: max_tokens 4 and 30 on one prompt are two kinds of call whichever
    comes first, and the session budget's cut (which depends on the other calls' reservations) is not part of it."""
    from nemo_like.models.generation.interface import SamplingParams
    from nemo_like.serving.sessions import call_settings

    short, long = call_settings(SamplingParams(max_new_tokens=4)), call_settings(SamplingParams(max_new_tokens=30))
    seeds = []
    for order in ((short, long), (long, short)):
        store = SessionStore()
        store.open("s", {SEED_KEY: 3})
        session = store.session("s")
        seeds.append(dict(zip(order, (store.call_seed(session, [5, 6], kind) for kind in order))))
    assert seeds[0] == seeds[1] and seeds[0][short] != seeds[0][long]
    assert call_settings(SamplingParams(max_new_tokens=4), 2) != short  # n choices: another kind too
