"""Agent tasks' pure parts (outcomes, failures, deadlines, per-session advantages, settings, plan) and the seeded,
budgeted sessions and ``nemo-like serve`` against the real server over the shipped tiny tool model."""

from __future__ import annotations

import asyncio
import contextlib
import io
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from nemo_like.config import ConfigError, load_config
from nemo_like.environments.agent import AgentConfig, AgentSettings, final_answer, load_agent_settings
from nemo_like.experience.agent_rollouts import outcome_of, per_session, run_session
from nemo_like.plan.run_plan import agent_tasks
from nemo_like.serving.standalone import build_server, serve
from nemo_like.utils.imports import import_object
from nemo_like.utils.seeds import agent_call_seed, agent_session_seed

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_agent_tiny_cpu.yaml"
AGENT = "examples/agents/calculator_agent.py:solve"
ASYNC = ("grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true")


def test_an_agent_return_is_a_reward_an_answer_to_verify_or_a_failure() -> None:
    assert outcome_of(1, True).reward == 1.0 and outcome_of(0.5, False).reward == 0.5
    assert outcome_of(float("nan"), True).failure == "bad_return"
    assert outcome_of(True, True).failure == "bad_return"  # a bool is not a reward
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "9716"}, {"role": "tool", "content": "x"}]
    assert outcome_of(messages, True).answer == "9716"
    assert outcome_of("42", True).answer == "42"
    assert outcome_of(messages, False).failure == "bad_return"  # messages need env.<task>.verifier
    assert outcome_of({"a": 1}, True).failure == "bad_return"
    assert final_answer([{"role": "user", "content": "q"}]) == ""


def settings(fn, **limits) -> AgentSettings:
    return AgentSettings("t", AgentConfig(agent="x:y", verifier="tool", **limits), fn)


def run(fn, **limits):
    ended = []

    async def go():
        return await run_session(settings(fn, **limits), (1, 2, 3, 4, 5), asyncio.Semaphore(1), lambda: ended.append(True))

    return asyncio.run(go()), ended


def test_a_session_that_raises_hangs_or_returns_ends_its_session_once() -> None:
    def raises(*args):
        raise RuntimeError("bug")

    outcome, ended = run(raises)
    assert outcome.failure == "error" and "RuntimeError: bug" in outcome.detail and ended == [True]
    hang = threading.Event()
    outcome, ended = run(lambda *args: hang.wait(10), deadline_s=0.2)
    assert outcome.failure == "deadline" and ended == [True]
    hang.set()

    async def slow(*args):
        await asyncio.sleep(10)

    outcome, _ = run(slow, deadline_s=0.2)
    assert outcome.failure == "deadline"

    async def fine(base_url, api_key, session_id, prompt, metadata):
        return float(base_url + metadata)

    outcome, ended = run(fine)
    assert outcome.reward == 6.0 and outcome.failure is None and ended == [True]

    def own_timeout(*args):  # the agent's HTTP read timed out, long before its deadline: its own error
        raise TimeoutError("read timed out")

    outcome, ended = run(own_timeout, deadline_s=30.0)
    assert (outcome.failure, outcome.detail) == ("error", "TimeoutError: read timed out") and ended == [True]

    async def exits(*args):
        raise SystemExit(2)

    for agent in (exits, lambda *args: sys.exit(3)):  # sys.exit in an agent fails its session, not the whole batch
        outcome, ended = run(agent)
        assert outcome.failure == "error" and outcome.detail.startswith("SystemExit") and ended == [True]

    async def cancels_its_own_task(*args):  # a BaseException: it ended the whole batch as "the run is stopping"
        inner = asyncio.ensure_future(asyncio.sleep(10))
        inner.cancel()
        await inner

    outcome, ended = run(cancels_its_own_task)
    assert outcome.failure == "error" and outcome.detail.startswith("CancelledError") and ended == [True]

    async def cancelled_batch():  # the batch itself cancelled (AgentRollouts.cancel): still raised, its session ended
        ended: list[bool] = []
        session = asyncio.ensure_future(run_session(settings(slow), (1, 2, 3, 4, 5), asyncio.Semaphore(1), lambda: ended.append(True)))
        await asyncio.sleep(0.05)
        session.cancel()
        with pytest.raises(asyncio.CancelledError):
            await session
        return ended

    assert asyncio.run(cancelled_batch()) == [True]


def test_async_agents_of_every_shape_run_and_a_reward_past_floats_is_a_bad_return() -> None:
    """An object with an ``async def __call__`` and an ``async def`` under a ``functools.wraps`` decorator ran on a
    thread, returned an un-awaited coroutine and failed every session ('got coroutine'); an int reward too large for
    a float was counted as the agent's own error."""
    import functools

    class Agent:
        async def __call__(self, base_url, api_key, session_id, prompt, metadata):
            return 1.0

    def retried(function):
        @functools.wraps(function)
        def wrapper(*args):
            return function(*args)

        return wrapper

    @retried
    async def decorated(*args):
        return 0.5

    def hand_written(*args):  # a plain function returning a coroutine: awaited too
        return decorated(*args)

    assert settings(Agent()).is_async and settings(decorated).is_async and not settings(hand_written).is_async
    for agent, reward in ((Agent(), 1.0), (decorated, 0.5), (hand_written, 0.5)):
        outcome, ended = run(agent)
        assert (outcome.reward, outcome.failure, ended) == (reward, None, [True])
    outcome, _ = run(lambda *args: 10**400)
    assert outcome.failure == "bad_return" and "not finite" in outcome.detail
    assert outcome_of(-(10**400), False).failure == "bad_return"


def test_a_branched_session_weighs_once_in_its_group() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    owners = torch.tensor([0, 0, 1, 2, 2, 3])  # session 0 has two rows, session 2 two
    first, row_index = per_session(owners)
    assert rewards[first].tolist() == [1.0, 0.0, 0.5, 0.5] and groups[first].tolist() == [0, 0, 1, 1]
    assert row_index.tolist() == [0, 0, 1, 2, 2, 3]
    session_advantages = torch.tensor([0.5, -0.5, 0.0, 0.0])
    assert session_advantages[row_index].tolist() == [0.5, 0.5, -0.5, 0.0, 0.0, 0.0]


def test_agent_seeds_depend_only_on_the_batch_sample_and_call() -> None:
    assert agent_session_seed(7, 3) == agent_session_seed(7, 3) != agent_session_seed(7, 4)
    # A call's seed: the session's, the call's prompt ids and how many earlier calls of the session sent those ids
    assert agent_call_seed(5, [1, 2]) == agent_call_seed(5, [1, 2], 0) != agent_call_seed(5, [1, 2], 1)
    assert agent_call_seed(5, [1, 2]) != agent_call_seed(5, [2, 1]) != agent_call_seed(6, [2, 1])
    assert agent_call_seed(5, [1, 2]) != agent_call_seed(5, [1, 2, 0])
    assert 0 <= agent_call_seed(agent_session_seed(1, 2), [3, 4], 3) < 2**31


def test_agent_settings_errors_name_the_key() -> None:
    assert load_agent_settings("tool", {"agent": AGENT, "verifier": "tool"}).function.__name__ == "solve"
    with pytest.raises(ConfigError, match=r"env\.tool\.agent: cannot import"):
        load_agent_settings("tool", {"agent": "no_such_pkg.mod:solve"})
    # a recipe's relative agent path run from elsewhere: the error named neither the directory nor the file form
    with pytest.raises(ConfigError) as missing:
        load_agent_settings("tool", {"agent": "agents/nowhere.py:solve"})
    assert f"no Python file at agents/nowhere.py (relative to the working directory {Path.cwd()}: give an absolute path" in str(
        missing.value
    )
    assert str(missing.value).endswith("expected 'package.module:function' or 'path/to/file.py:function'")
    with pytest.raises(ConfigError, match=r"env\.tool\.agent: .*must accept \(base_url, api_key, session_id, prompt, metadata\)"):
        load_agent_settings("tool", {"agent": "examples/agents/calculator_agent.py:run_tool"})
    with pytest.raises(ConfigError, match=r"env\.tool\.verifier"):
        load_agent_settings("tool", {"agent": AGENT, "verifier": "toool"})


def test_the_plan_decides_agent_tasks_once_for_sync_and_async_runs_and_refuses_mixed_ones(tmp_path) -> None:
    assert agent_tasks(load_config(RECIPE, [])) == ("tool",)
    assert agent_tasks(load_config(RECIPE, [*ASYNC])) == ("tool",)  # async agent runs: docs/guides/agents.md
    with pytest.raises(ConfigError, match=r"env\.arithmetic: a run with agent tasks"):
        agent_tasks(load_config(RECIPE, ["+env.arithmetic.num_workers=1"]))


@pytest.fixture(scope="module")
def server():
    srv = build_server(load_config(RECIPE, [])).start()
    yield srv
    srv.stop()


def sample(srv, session_id: str, max_tokens: int = 16) -> list[int]:
    client = openai.OpenAI(base_url=srv.base_url, api_key=srv.api_key, default_headers={"X-Session-Id": session_id}, max_retries=0)
    reply = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "What is 347 times 28?"}],
        max_tokens=max_tokens,
        extra_body={"return_token_ids": True},
    )
    return reply.choices[0].model_extra["completion_token_ids"]


def test_the_demo_agent_shares_one_client_and_each_call_lands_in_its_own_session(server) -> None:
    """The demo agent builds one OpenAI client per server (a client costs ~35 ms to build) and names its session per
    call: concurrent sessions on the shared client must each record exactly their own calls."""
    solve, clients = import_object(AGENT), import_object(AGENT.replace(":solve", ":_client"))
    clients.cache_clear()
    sessions = [server.sessions.open(metadata={"seed": 40 + i}) for i in range(4)]
    prompt = [{"role": "user", "content": "What is 347 times 28?"}]
    returned: dict[str, list] = {}
    threads = [
        threading.Thread(target=lambda sid=sid: returned.update({sid: solve(server.base_url, server.api_key, sid, prompt, {})}))
        for sid in sessions
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert (clients.cache_info().misses, clients.cache_info().hits) == (1, 3)  # one client built, though they started together
    for sid in sessions:
        calls = sum(m["role"] == "assistant" for m in returned[sid])
        result = server.sessions.end(sid)
        assert calls >= 1 and result.num_calls == calls, (sid, calls, result.num_calls)


def test_a_seeded_session_samples_the_same_calls_again_and_stops_at_its_budget(server) -> None:
    first = [server.sessions.open(metadata={"seed": 11}) for _ in range(3)]
    draws = [[sample(server, sid) for _ in range(2)] for sid in first]
    assert draws[0] == draws[1] == draws[2]  # same session seed: same draws call by call, whatever else runs
    other = server.sessions.open(metadata={"seed": 12})
    assert [sample(server, other) for _ in range(2)] != draws[0]
    budgeted = server.sessions.open(metadata={"seed": 11, "token_budget": 4})
    sample(server, budgeted, max_tokens=8)
    with pytest.raises(openai.BadRequestError, match="its budget is 4") as refused:
        sample(server, budgeted)
    assert refused.value.code == "session_budget_exceeded"


def test_nemo_like_serve_prints_a_url_and_key_that_answer_until_stopped() -> None:
    stop, out = threading.Event(), io.StringIO()
    with contextlib.redirect_stdout(out):
        thread = threading.Thread(target=serve, args=(load_config(RECIPE, []),), kwargs={"stop": stop})
        thread.start()
        for _ in range(600):
            if "api_key:" in out.getvalue():
                break
            time.sleep(0.05)
    lines = dict(line.split(": ", 1) for line in out.getvalue().splitlines())
    assert lines["base_url"].startswith("http://127.0.0.1:")
    answer = httpx.get(f"{lines['base_url']}/models", headers={"Authorization": f"Bearer {lines['api_key']}"})
    assert answer.status_code == 200 and answer.json()["data"][0]["id"] == "policy"
    assert httpx.get(f"{lines['base_url']}/models").status_code == 401
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_bad_seeds_prompts_and_rewards_are_400s_and_a_sessions_seed_beats_the_agents(server) -> None:
    """A seed past the engine's range failed the whole engine batch (500, also for the well-formed calls beside it);
    an empty completions prompt was a 500; a NaN reward was accepted; an agent's own seed made a group's sessions
    identical."""
    headers = {"Authorization": f"Bearer {server.api_key}"}
    chat = {"model": "policy", "messages": [{"role": "user", "content": "What is 347 times 28?"}], "max_tokens": 4}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as http:
        reply = http.post("/chat/completions", json={**chat, "seed": 2**64})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "seed"
        reply = http.post("/completions", json={"model": "policy", "prompt": "", "max_tokens": 2})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
        too_long = http.post("/completions", json={"model": "policy", "prompt": [5] * 100_000, "max_tokens": 2})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"  # not 'messages'
        opened = http.post("/sessions")  # no body: both fields are optional
        assert opened.status_code == 200
        nan_end = http.post(
            f"/sessions/{opened.json()['id']}/end", content=b'{"reward": NaN}', headers={"Content-Type": "application/json"}
        )
        assert nan_end.status_code == 400 and nan_end.json()["error"]["param"] == "reward"
    sessions = [server.sessions.open(metadata={"seed": 70 + i}) for i in range(4)]
    drawn = []
    for sid in sessions:  # each agent passes the same seed: the sessions' own seeds still decide
        client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key, default_headers={"X-Session-Id": sid}, max_retries=0)
        reply = client.chat.completions.create(
            model="policy", messages=chat["messages"], max_tokens=8, seed=42, extra_body={"return_token_ids": True}
        )
        drawn.append(tuple(reply.choices[0].model_extra["completion_token_ids"]))
        server.sessions.end(sid)
    assert len(set(drawn)) > 1


def test_a_server_that_cannot_bind_releases_its_socket_and_engine_thread(server, monkeypatch) -> None:
    import socket

    from nemo_like.serving import server as server_module
    from nemo_like.serving.server import RolloutServer, ServerConfig

    opened: list[socket.socket] = []
    real_socket = socket.socket

    def recorded_socket(*args, **kwargs) -> socket.socket:
        opened.append(real_socket(*args, **kwargs))
        return opened[-1]

    engine_threads = lambda: sum(t.name == "rollout-server-engine" for t in threading.enumerate())  # noqa: E731
    before = engine_threads()
    clash = RolloutServer(server.queue.engine, server.service.renderer.tokenizer, ServerConfig(port=server.port))
    monkeypatch.setattr(server_module.socket, "socket", recorded_socket)
    with pytest.raises(OSError, match="in use"):
        clash.start()
    monkeypatch.undo()
    assert opened and all(sock.fileno() == -1 for sock in opened)  # every socket the failed start opened is closed
    assert engine_threads() == before


def test_verifier_kwargs_without_a_verifier_warn_that_nothing_reads_them() -> None:
    from nemo_like.algorithms.setup import multi_turn_warnings
    from nemo_like.environments.registry import resolve_environments

    def warnings_of(*overrides: str) -> list[str]:
        cfg = load_config(RECIPE, list(overrides), warn=False)
        return [w for w in multi_turn_warnings(cfg, resolve_environments(cfg.env_sections)) if "verifier" in w]

    assert warnings_of() == []  # the recipe's verifier reads them
    (line,) = warnings_of("env.tool.verifier=null")
    assert line.startswith("env.tool.verifier_kwargs has no effect: env.tool.verifier is not set")
    # turns: an agent decides its session's calls (the line had called the task single-turn, overlap scoring and all)
    cfg = load_config(RECIPE, ["grpo.max_rollout_turns=3"], warn=False)
    assert multi_turn_warnings(cfg, resolve_environments(cfg.env_sections)) == [
        "grpo.max_rollout_turns=3 does not bound agent task env.tool: its agent decides how many model calls a session "
        "makes (bounded by env.tool.max_tokens_per_session); it adds the multi_turn/* metrics only"
    ]
    # a composite verifier's own lines (a source at weight 0), named under verifier_kwargs
    cfg = load_config(
        RECIPE,
        [
            "env.tool.verifier=composite",
            "+env.tool.verifier_kwargs.sources={correct: {class: arithmetic}, length: {class: length_penalty, weight: 0}}",
        ],
        warn=False,
    )
    assert [w for w in multi_turn_warnings(cfg, resolve_environments(cfg.env_sections)) if "weight=0" in w] == [
        "env.tool.verifier_kwargs.sources.length.weight=0: the source is computed and logged but does not change the reward "
        "(a NaN or infinite one still stops the run)"
    ]


def test_plan_refuses_an_agent_that_does_not_import_as_train_does(capsys) -> None:
    from nemo_like.cli import main

    assert main(["plan", "--config", str(RECIPE), "env.tool.agent=examples/agents/calculator_agent.py:solv"]) == 2
    assert "env.tool.agent: cannot import 'examples/agents/calculator_agent.py:solv'" in capsys.readouterr().err


def test_ending_a_session_does_not_hold_up_the_servers_other_requests(server, monkeypatch) -> None:
    """``POST /sessions/{id}/end`` ran on the event loop: building a long session's rows (~0.9 s at 400 calls), or
    waiting for the run ending the same session, held every other request. A slow end (held here on an event) now
    leaves the server answering."""
    release, entered = threading.Event(), threading.Event()
    real_end = server.sessions.end

    def slow_end(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return real_end(*args, **kwargs)

    monkeypatch.setattr(server.sessions, "end", slow_end)
    headers = {"Authorization": f"Bearer {server.api_key}"}
    sid = server.sessions.open()
    ending = threading.Thread(target=lambda: httpx.post(f"{server.base_url}/sessions/{sid}/end", headers=headers, timeout=120))
    ending.start()
    try:
        assert entered.wait(60)
        models = httpx.get(f"{server.base_url}/models", headers=headers, timeout=20)  # timed out while the end held the loop
        assert models.status_code == 200
    finally:
        release.set()
        ending.join(120)
