"""The session store: creation rules, the 404/409 answers, one result per session, the agent/* counters."""

from __future__ import annotations

import threading
import time

import pytest

from nemo_like.serving.errors import ServingError
from nemo_like.serving.sessions import SessionStore
from nemo_like.serving.trajectory import CallRecord


def record(store: SessionStore, session_id: str, prompt: list[int], completion: list[int]) -> None:
    session, index = store.begin_call(session_id)
    rec = CallRecord(tuple(prompt), tuple(completion), tuple([-0.5] * len(completion)), 0, 0, call_index=index)
    store.record(session, [rec], [("p", "c")])
    store.end_call(session)


def test_calls_are_recorded_per_session_and_end_builds_rows_once():
    ended_ids: list[str] = []
    store = SessionStore(on_end=ended_ids.append)
    record(store, "a", [1, 2], [10, 2])
    record(store, "b", [1, 3], [11, 2])
    record(store, "a", [1, 2, 10, 2, 4], [12, 2])
    result = store.end("a", reward=1.0)
    assert result.rejected is None and len(result.rows) == 1
    assert result.rows[0].response_ids == [10, 2, 4, 12, 2]
    assert store.end("a") is result  # ending twice answers the same result
    assert ended_ids == ["a"]  # told once (the generation queue stops waiting for its calls)
    assert store.open_ids() == ["b"]
    assert [r.session_id for r in store.take_finished()] == ["a"]
    with pytest.raises(ServingError) as ended:
        store.begin_call("a")
    assert ended.value.status == 409


def test_unknown_sessions_are_404_without_auto_create_and_ids_are_unique():
    store = SessionStore(auto_create=False)
    with pytest.raises(ServingError) as unknown:
        store.begin_call("nope")
    assert unknown.value.status == 404 and unknown.value.body()["error"]["code"] == "session_not_found"
    with pytest.raises(ServingError):
        store.end("nope")
    opened = store.open(metadata={"task": "x"})
    assert store.session(opened).metadata == {"task": "x"}
    with pytest.raises(ValueError, match="already exists"):
        store.open(opened)


def test_counters_cover_branched_and_rejected_sessions():
    store = SessionStore(vocab_size=100)
    record(store, "one", [1], [10, 2])
    record(store, "branched", [1], [10, 2])
    record(store, "branched", [5, 10, 2], [11, 2])  # does not extend [1, 10, 2]
    record(store, "bad", [1], [500])  # outside the vocabulary
    for session_id in ("one", "branched", "bad"):
        store.end(session_id, 1.0)
    assert store.take_result("bad").rejected
    assert store.metrics() == {
        "agent/sessions": 3.0,
        "agent/branched_sessions": 1.0,
        "agent/rejected_sessions": 1.0,
        "agent/rows_per_session": 1.5,  # 1 + 2 rows of the 2 sessions with rows (the rejected one has none)
        "agent/calls_per_session": 4 / 3,
        "agent/abandoned_calls": 0.0,
    }


def test_a_call_that_finishes_after_its_session_ended_is_dropped():
    store = SessionStore()
    session, index = store.begin_call("s")
    store.end("s")
    with pytest.raises(ServingError) as late:
        store.record(session, [CallRecord((1,), (2,), (-0.1,), 0, 0, call_index=index)], [("p", "c")])
    assert late.value.status == 409


def test_an_end_that_arrives_while_the_first_builds_the_rows_gets_the_same_result():
    """The agent's own POST .../end racing the run's end: the second waits for the rows instead of answering 409
    (which failed the run's whole agent batch)."""
    building, finish = threading.Event(), threading.Event()

    def on_end(session_id: str) -> None:  # runs between "ended" and "rows stored": hold the first end there
        building.set()
        assert finish.wait(10)

    store = SessionStore(on_end=on_end)
    record(store, "a", [1, 2], [10, 2])
    results = []
    first = threading.Thread(target=lambda: results.append(store.end("a", reward=1.0)))
    first.start()
    assert building.wait(10)
    second = threading.Thread(target=lambda: results.append(store.end("a")))
    second.start()
    second.join(0.2)
    assert second.is_alive()  # waiting for the first end's rows, not answering 409
    finish.set()
    first.join(10)
    second.join(10)
    assert len(results) == 2 and results[0] is results[1] and results[0].rows[0].reward == 1.0
    assert store.metrics()["agent/sessions"] == 1.0  # counted once


def test_the_server_accepts_every_id_the_model_can_sample_not_only_the_tokenizers(tmp_path) -> None:
    """A model padded past its tokenizer (Qwen2.5: 151,936 rows for 151,665 ids) samples the padding ids too: a session
    holding one was refused whole (failure_reward, none of its tokens trained). Here: the shipped model padded to 370."""
    from nemo_like.config import load_config
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.loading import load_causal_lm, load_tokenizer, model_vocab_size
    from nemo_like.serving.standalone import build_server

    model = load_causal_lm(EMBEDDED_MODEL)
    model.resize_token_embeddings(370)
    model.save_pretrained(tmp_path / "padded")
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    assert len(tokenizer) == 359 and model_vocab_size(str(tmp_path / "padded")) == 370
    cfg = load_config(None, [f"policy.model_name={tmp_path / 'padded'}", f"policy.tokenizer_name={EMBEDDED_MODEL}"])
    assert build_server(cfg).sessions.vocab_size == 370
    store = SessionStore(vocab_size=370)
    record(store, "padded", [1], [369])
    assert store.end("padded", 1.0).rows  # trained
    record(store, "outside", [1], [370])
    assert not store.end("outside", 1.0).rows


def test_a_second_end_with_another_reward_is_refused_and_the_kept_results_and_ids_are_bounded(monkeypatch):
    """A second end's different reward had been answered with the first's rows and dropped without a word; a server
    nobody takes results from (``nemo-like serve``) had kept every ended session's rows and id forever."""
    from nemo_like.serving import sessions

    store = SessionStore(max_kept_results=2)
    record(store, "a", [1, 2], [10, 2])
    first = store.end("a", reward=0.25)
    assert store.end("a", reward=0.25) is first and store.end("a") is first  # the same reward, or none: the same result
    with pytest.raises(ServingError) as conflict:
        store.end("a", reward=1.0)
    assert (conflict.value.status, conflict.value.param) == (409, "reward") and "0.25" in conflict.value.message
    for sid in ("b", "c"):
        record(store, sid, [1, 3], [11, 2])
        store.end(sid, reward=1.0)
    with pytest.raises(ServingError) as forgotten:  # past max_kept_results=2 the oldest result went: a repeated end is 409
        store.end("a", reward=0.25)
    assert forgotten.value.status == 409
    assert [r.session_id for r in store.take_finished()] == ["b", "c"]
    monkeypatch.setattr(sessions, "MAX_ENDED_IDS", 3)
    for sid in ("d", "e"):
        record(store, sid, [1, 4], [12, 2])
        store.end(sid)
    assert list(store._ended) == ["c", "d", "e"]  # the ids of ended sessions, the oldest forgotten past the cap


def test_a_session_whose_calls_were_all_refused_says_it_recorded_none() -> None:
    """A session whose only call was refused (its token budget) was rejected as having "made no calls"."""
    store = SessionStore()
    session, _ = store.begin_call("b")  # refused (a 400): nothing recorded
    store.end_call(session)
    refused = store.end("b")
    assert (refused.num_calls, refused.rejected, refused.rows) == (0, "the session recorded no calls", [])


def test_an_end_without_a_reward_leaves_it_to_a_later_end_that_gives_one() -> None:
    """The agent ends its own session without a reward and a harness around the server ends it with its verifier's: the
    rows had kept the first end's 0.0 and the 1.0 was dropped without a word. Also when the second end arrives while
    the first is still building the rows, and not on a result already taken (a 409 then)."""
    store = SessionStore()
    record(store, "a", [1, 2], [10, 2])
    first = store.end("a")
    assert first.reward == 0.0 and [row.reward for row in first.rows] == [0.0]
    assert store.end("a", reward=1.0) is first and first.reward == 1.0 and [row.reward for row in first.rows] == [1.0]
    assert store.end("a") is first and first.reward == 1.0  # an end without a reward changes nothing
    with pytest.raises(ServingError) as conflict:  # the reward is given now: another one contradicts it
        store.end("a", reward=0.5)
    assert (conflict.value.status, conflict.value.param) == (409, "reward")

    building, release = threading.Event(), threading.Event()

    def held_build(session_id: str) -> None:
        building.set()
        assert release.wait(30)

    store = SessionStore(on_end=held_build)
    record(store, "b", [1, 3], [11, 2])
    results: dict[str, object] = {}
    agent = threading.Thread(target=lambda: results.update(agent=store.end("b")))
    agent.start()
    assert building.wait(30)
    run = threading.Thread(target=lambda: results.update(run=store.end("b", reward=1.0)))
    run.start()
    deadline = time.monotonic() + 30
    while store._end_rewards.get("b") is None and time.monotonic() < deadline:  # the second end registered its reward
        run.join(0.01)
    assert store._end_rewards.get("b") == 1.0
    release.set()
    for thread in (agent, run):
        thread.join(30)
        assert not thread.is_alive()
    assert results["agent"] is results["run"] and results["run"].reward == 1.0 and results["run"].rows[0].reward == 1.0
    taken = store.take_result("b")
    with pytest.raises(ServingError) as late:
        store.end("b", reward=0.5)
    assert late.value.status == 409 and taken.reward == 1.0


def test_a_session_whose_rows_fail_to_build_keeps_no_reward_behind() -> None:
    """The first end's reward is kept to refuse a contradicting second end; a session whose rows failed to build had
    left it behind for the store's whole life (one entry per such session, never dropped)."""

    def on_end(session_id: str) -> None:
        raise RuntimeError("the agent's end hook failed")

    store = SessionStore(on_end=on_end)
    sid = store.open()
    with pytest.raises(RuntimeError, match="end hook failed"):
        store.end(sid, 1.0)
    assert store._end_rewards == {}


def test_a_server_nobody_takes_results_from_ends_its_least_recently_used_session_past_the_cap():
    """``nemo-like serve`` kept every session an agent's calls opened and never ended (a new X-Session-Id per episode
    without /end), with every call's ids and texts, forever."""
    store = SessionStore(max_kept_results=2)
    record(store, "a", [1, 2], [10, 2])
    record(store, "b", [1, 3], [11, 2])
    record(store, "a", [1, 2, 10, 2, 5], [12, 2])  # "a" used last: "b" is the least recently used
    record(store, "c", [1, 4], [13, 2])
    assert sorted(store.open_ids()) == ["a", "c"]
    assert [(r.session_id, r.num_calls) for r in store.take_finished()] == [("b", 1)]  # ended with its call, as by /end
    with pytest.raises(ServingError) as ended:
        store.session("b")
    assert ended.value.status == 409
    # A session with a call in flight is never the one ended, however long ago it began: its call would be lost (409)
    busy, index = store.begin_call("slow")  # its call still sampling; "a" ends for its room
    record(store, "d", [1, 5], [14, 2])  # "c" ends: "slow" is the least recently used now
    assert sorted(store.open_ids()) == ["d", "slow"]
    record(store, "e", [1, 6], [15, 2])  # "d" ends, not "slow": its call is in flight
    assert sorted(store.open_ids()) == ["e", "slow"]
    store.record(busy, [CallRecord((1, 7), (16, 2), (-0.5, -0.5), 0, 0, call_index=index)], [("p", "c")])  # no 409
    store.end_call(busy)
    assert store.end("slow").num_calls == 1
    # Every open session busy: a new one is let in over the cap; once they are idle, the next new one ends the surplus
    calls = [store.begin_call(sid)[0] for sid in ("g", "h")]  # "e" ends for room; "g" and "h" in flight
    record(store, "i", [1, 8], [17, 2])
    assert sorted(store.open_ids()) == ["g", "h", "i"]
    for session in calls:
        store.end_call(session)
    record(store, "j", [1, 9], [18, 2])
    assert sorted(store.open_ids()) == ["i", "j"]
    unbounded = SessionStore()  # a training run's store: its driver ends every session itself
    for sid in "abc":
        record(unbounded, sid, [1, 2], [10, 2])
    assert sorted(unbounded.open_ids()) == ["a", "b", "c"]
