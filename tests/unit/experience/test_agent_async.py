"""Agent sessions in async runs: a session's age counts from its first call's weight version (every row of it, a
branched one included), the replay buffer's bound and the per-session advantages see that through the buffer, the
engine gate keeps refits out of engine calls, and a stopping run cancels the agent batch in flight."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from nemo_like.data.prompts import PromptRecord
from nemo_like.environments.agent import AgentConfig, AgentSettings
from nemo_like.experience.agent_rollouts import (
    AGENT_THREAD,
    AgentRollouts,
    AgentRolloutsClosed,
    EngineGate,
    per_session,
    session_samples,
    session_version,
)
from nemo_like.experience.async_rollouts import rollout_from_groups
from nemo_like.experience.replay_buffer import ReplayBuffer, ReplayBufferError
from nemo_like.experience.rollouts import Rollout
from nemo_like.experience.trajectory_collector import AgentTrajectoryGroup, agent_batch_counters, split_into_groups
from nemo_like.models.generation.interface import GeneratedSample
from nemo_like.serving.sessions import SessionStore
from nemo_like.serving.trajectory import CallRecord, session_rows


def call(prompt: list[int], completion: list[int], index: int, version: int) -> CallRecord:
    return CallRecord(tuple(prompt), tuple(completion), tuple(-0.5 for _ in completion), version, version, call_index=index)


def spanning_session() -> object:
    """Call 0 at v0; call 1 at v1 extends it (one row sampled by two versions)."""
    return session_rows("a", [call([1, 2], [10, 2], 0, 0), call([1, 2, 10, 2, 5], [11, 2], 1, 1)], 1.0)


def branched_spanning_session() -> object:
    """Call 0 at v0; a rewritten history makes call 1 (at v1) a second row that starts at v1."""
    return session_rows("b", [call([1, 2], [10, 2], 0, 0), call([1, 9, 10, 2, 5], [11, 2], 1, 1)], 0.0)


def test_every_row_of_a_session_counts_from_its_first_calls_version():
    one = spanning_session()
    assert session_version(one) == 0
    (sample,) = session_samples(one, open_version=7)
    assert (sample.weight_version, sample.final_weight_version, sample.refitted_mid_sequence) == (0, 1, True)
    branched = branched_spanning_session()
    assert branched.branched and [r.weight_version for r in branched.rows] == [0, 1]  # per row, the second starts at v1
    rows = session_samples(branched, open_version=7)
    assert [s.weight_version for s in rows] == [0, 0]  # ... but the session's age counts from its first call
    assert [s.refitted_mid_sequence for s in rows] == [False, True]
    assert session_version(None) is None and session_samples(None, open_version=7) == []  # a row-less session: placeholder


def agent_rollout() -> Rollout:
    """Two prompts x 2 sessions: sessions 0 (spanning, one row) and 1 (branched, spanning) of prompt 0; 2 and 3
    (v1 only) of prompt 1."""
    prompt = PromptRecord("p", [], [1, 2], {})
    steady = session_rows("c", [call([1, 2], [10, 2], 0, 1)], 1.0)
    results = [spanning_session(), branched_spanning_session(), steady, steady]
    samples, owners, groups = [], [], []
    for index, result in enumerate(results):
        for sample in session_samples(result, open_version=1):
            samples.append(sample)
            owners.append(index)
            groups.append(index // 2)
    metrics = {"agent/sessions": 4.0, "agent/rows_per_session": 1.25, "env/agent/correct": 2.0}
    return Rollout(
        [prompt] * len(samples), torch.tensor(groups), samples, ["x"] * len(samples), torch.ones(len(samples)), metrics,
        session_of_row=torch.tensor(owners),
    )  # fmt: skip


def test_the_buffer_bounds_a_spanning_sessions_age_from_its_first_call():
    rollout = agent_rollout()
    groups = split_into_groups(rollout, target_step=2)
    assert all(isinstance(g, AgentTrajectoryGroup) for g in groups) and [g.session_of_row for g in groups] == [[0, 1, 1], [2, 3]]
    assert groups[0].generation_version == 0
    fresh = ReplayBuffer(groups_per_step=2, max_age=1)
    fresh.push(groups)
    taken = fresh.take(2, trainer_version=1)  # step 2 trains v1: the spanning sessions are 1 update old
    assert [1 - s.weight_version for g in taken for s in g.samples] == [1, 1, 1, 0, 0]
    strict = ReplayBuffer(groups_per_step=2, max_age=0)
    strict.push(split_into_groups(rollout, target_step=2))
    with pytest.raises(ReplayBufferError, match="ages 0..1"):  # counted from the last call they would pass as age 0
        strict.take(2, trainer_version=1)


def test_agent_groups_come_out_of_the_buffer_with_their_sessions_and_counters():
    rollout = agent_rollout()
    counters = agent_batch_counters(rollout)
    assert counters == {
        "agent/sessions": 4.0,
        "agent/rows_per_session": 1.25,
        "agent/sessions_across_refits": 2.0,
        "env/agent/correct": 2.0,
    }
    groups = split_into_groups(rollout, target_step=1)
    groups[0].batch_metrics = counters
    back = rollout_from_groups(groups)
    assert back.env_metrics == counters
    first, row_index = per_session(back.session_of_row)
    assert len(first) == 4 and row_index.tolist() == [0, 1, 1, 2, 3]  # the branched session weighs once
    assert back.group_ids.tolist() == [0, 0, 0, 1, 1]
    ordinary = Rollout(rollout.prompts, rollout.group_ids, rollout.samples, rollout.response_texts, rollout.rewards)
    plain = rollout_from_groups(split_into_groups(ordinary, target_step=1))  # not an agent batch: as before
    assert plain.session_of_row is None and plain.env_metrics == {}


class BlockingEngine:
    """An engine whose generate call blocks until ``proceed`` is set."""

    def __init__(self) -> None:
        self.weight_version = 3
        self.inside = threading.Event()
        self.proceed = threading.Event()
        self.calls = 0
        self.returning = threading.Event()  # set as a call returns

    def generate(self, prompts, params, seed):
        self.calls += 1
        self.inside.set()
        assert self.proceed.wait(10)
        self.returning.set()
        return [GeneratedSample(list(p), [1], [-0.1], False, self.weight_version) for p in prompts]


def test_the_engine_gate_keeps_a_refit_out_of_an_engine_call():
    engine = BlockingEngine()
    gate = EngineGate(engine)
    assert gate.weight_version == 3
    first = threading.Thread(target=gate.generate, args=([[1]], None, 0))
    first.start()
    assert engine.inside.wait(10)
    held, waited = [], []
    holder = threading.Thread(target=lambda: waited.append((gate.hold(), engine.returning.is_set())))
    holder.start()
    time.sleep(0.2)
    assert holder.is_alive()  # the refit waits for the call in flight
    engine.proceed.set()
    holder.join(10)
    first.join(10)
    assert waited and waited[0][1]  # hold() returned only once the call in flight had returned
    time.sleep(0.2)  # held with no call waiting: counted in waiting_for_pacing already, not as paused for the refit
    before_call = time.perf_counter()
    second = threading.Thread(target=lambda: held.append(gate.generate([[2]], None, 0)))
    second.start()
    time.sleep(0.2)
    assert engine.calls == 1 and second.is_alive()  # no engine call while held
    paused = gate.release()
    assert 0.0 < paused <= time.perf_counter() - before_call  # from the call that waited, not from the hold
    assert gate.held_seconds == paused  # the running total the collector takes out of its generation seconds
    second.join(10)
    assert engine.calls == 2 and held[0][0].prompt_ids == [2]
    assert gate.hold() >= 0.0 and gate.release() == 0.0 and gate.held_seconds == paused  # no call waited at all: 0
    gate.close()
    with pytest.raises(AgentRolloutsClosed):
        gate.generate([[3]], None, 0)


def test_a_stopping_run_cancels_the_agent_batch_in_flight_and_ends_its_sessions():
    release = threading.Event()
    started = threading.Semaphore(0)

    def hangs(base_url, api_key, session_id, prompt, metadata):
        started.release()
        release.wait(20)
        return 1.0

    store = SessionStore(auto_create=False)
    expected: list[str] = []  # sessions whose agents started (the server waits for their first calls)
    server = SimpleNamespace(sessions=store, base_url="http://127.0.0.1:1/v1", api_key="k", expect_calls=expected.append)
    settings = {"t": AgentSettings("t", AgentConfig(agent="x:y", deadline_s=30.0, max_concurrency=2), hangs)}
    agents = AgentRollouts(server, settings, SimpleNamespace(pad_token_id=0), SimpleNamespace(weight_version=0))
    envs = SimpleNamespace(tasks=["t"])
    prompts = [PromptRecord("p", [{"role": "user", "content": "q"}], [1, 2], {"task_name": "t"})]
    raised = []

    def collect():
        try:
            agents.collect(envs, prompts, 3, seed=0)  # the third session waits for its turn (max_concurrency 2)
        except AgentRolloutsClosed as exc:
            raised.append(exc)

    collector = threading.Thread(target=collect)
    collector.start()
    assert started.acquire(timeout=10) and started.acquire(timeout=10)  # both sessions' agents are running
    assert len(store.open_ids()) == 3 and len(expected) == 2 and set(expected) < set(store.open_ids())
    agents.cancel()
    collector.join(10)
    assert not collector.is_alive() and raised
    assert store.open_ids() == []  # the sessions ended (the waiting one too): the agents' next calls are refused (409)
    assert agents.close(join_s=0.1) == 2  # their threads still run user code (daemon threads, left behind)
    release.set()
    assert agents.close(join_s=5) == 0
    assert not [t for t in threading.enumerate() if t.name == AGENT_THREAD]
    with pytest.raises(AgentRolloutsClosed):  # no new batch once the run stops
        agents.collect(envs, prompts, 1, seed=0)


def test_rows_per_session_counts_the_rows_of_sessions_not_a_failed_sessions_placeholder():
    """One session makes a call and returns; the other raises before calling: one row of the one session with rows
    (1.0, as the session store counts: no session branched), though the batch holds two rows (the failed one's
    placeholder)."""
    store = SessionStore(auto_create=False, vocab_size=100)

    def agent(base_url, api_key, session_id, prompt, metadata):
        if metadata["fails"]:
            raise RuntimeError("before any call")
        session, index = store.begin_call(session_id)
        store.record(session, [call([1, 2], [10, 2], index, 0)], [("p", "c")])
        return 1.0

    server = SimpleNamespace(sessions=store, base_url="http://127.0.0.1:1/v1", api_key="k", expect_calls=lambda session_id: None)
    settings = {"t": AgentSettings("t", AgentConfig(agent="x:y", deadline_s=30.0), agent)}
    tokenizer = SimpleNamespace(pad_token_id=0, decode=lambda ids, **kwargs: "")
    agents = AgentRollouts(server, settings, tokenizer, SimpleNamespace(weight_version=0))
    prompts = [PromptRecord(f"p{i}", [{"role": "user", "content": "q"}], [1, 2], {"task_name": "t", "fails": i == 1}) for i in range(2)]
    rollout = agents.collect(SimpleNamespace(tasks=["t"]), prompts, 1, seed=0)
    assert len(rollout.samples) == 2 and rollout.rewards.tolist() == [1.0, 0.0]
    assert rollout.env_metrics["agent/rows_per_session"] == 1.0 == store.metrics()["agent/rows_per_session"]
    assert rollout.env_metrics["agent/sessions_with_rows"] == 1.0 and rollout.env_metrics["agent/sessions"] == 2.0
    assert rollout.env_metrics["agent/failures/error"] == 1.0
    agents.close(join_s=1)


def test_generation_counters_saved_before_the_batches_carried_their_env_counters_still_load():
    """An async checkpoint's ``unreported_generation`` held ``env_counters`` (the batches since the last step) until the
    counters moved onto the batches' groups: a resume from it must not fail on the key."""
    from nemo_like.experience.trajectory_collector import GenerationStats

    stats = GenerationStats.restored({"batches": 2, "generation_seconds": 1.5, "env_counters": {"env/arithmetic/x": 3.0}})
    assert stats.batches == 2 and stats.generation_seconds == 1.5
    assert GenerationStats.restored(None) == GenerationStats()
