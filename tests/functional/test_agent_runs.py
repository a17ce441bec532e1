"""A GRPO run through a user's agent (issue 29), end to end: real Ray actors, the shipped tiny tool model, the rollout
server on 127.0.0.1, the real ``openai`` client over real HTTP; then the same agent in an async run on the same
cluster, a refit forced between two calls of some sessions. The agents below are named in the recipe by this file's
path; the run imports them (the same module object as ``import_object`` returns here), so what they record is
readable from the test."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
import torch
from functional.helpers import read_jsonl, read_metrics

from nemo_like.config import load_config
from nemo_like.experience.async_rollouts import AsyncRollouts
from nemo_like.models.loading import load_tokenizer
from nemo_like.train import train
from nemo_like.utils.imports import import_object

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "configs" / "grpo_agent_tiny_cpu.yaml"
CALCULATOR = f"{ROOT / 'examples' / 'agents' / 'calculator_agent.py'}"
THIS = Path(__file__).resolve()

RECORDED: dict[str, list[tuple]] = {}  # session id -> (prompt ids, completion ids, logprobs) of each call, as served
INVOCATIONS = itertools.count()
RAISES, HANGS = 3, 5  # of every 8 consecutive sessions (a step has 8), one raises after its first call, one hangs


def recording_agent(base_url: str, api_key: str, session_id: str, prompt: list[dict], metadata: dict) -> list[dict]:
    """The demo's loop (openai client, our calculator), asking the server for the sampled ids of each call."""
    from openai import OpenAI

    schema, run_tool = import_object(f"{CALCULATOR}:CALCULATOR_SCHEMA"), import_object(f"{CALCULATOR}:run_tool")
    turn = next(INVOCATIONS) % 8
    client = OpenAI(base_url=base_url, api_key=api_key, default_headers={"X-Session-Id": session_id}, max_retries=0)
    messages = list(prompt)
    for _ in range(2):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=[schema], max_tokens=16, extra_body={"return_token_ids": True}
        )
        choice = reply.choices[0]
        extra = choice.model_extra
        call = (reply.model_extra["prompt_token_ids"], extra["completion_token_ids"], extra["completion_logprobs"])
        RECORDED.setdefault(session_id, []).append(call)
        if turn == RAISES:
            raise RuntimeError("a bug in the agent")
        messages.append(choice.message.model_dump(exclude_none=True))
        if not choice.message.tool_calls:
            break
        messages += [{"role": "tool", "tool_call_id": c.id, "content": run_tool(c)} for c in choice.message.tool_calls]
    if turn == HANGS:
        threading.Event().wait(30)  # past deadline_s: abandoned, its session fails
    return messages


ASYNC_RECORDED: dict[str, list[tuple]] = {}  # session id -> (prompt ids, completion ids, logprobs, weight version) per call
ASYNC_INVOCATIONS = itertools.count()
FIRST_CALLS, REFITTED = threading.Event(), threading.Event()  # step 2's sessions made a call / the step-1 refit landed


def spanning_agent(base_url: str, api_key: str, session_id: str, prompt: list[dict], metadata: dict) -> list[dict]:
    """Two calls per session (the calculator's result, or the model's own answer, in between). The sessions of the
    second batch (generated for step 2 while step 1 trains) wait after their first call for the step-1 refit, so
    their second call samples with the next weights: their calls span a refit."""
    from openai import OpenAI

    schema, run_tool = import_object(f"{CALCULATOR}:CALCULATOR_SCHEMA"), import_object(f"{CALCULATOR}:run_tool")
    second_batch = 8 <= next(ASYNC_INVOCATIONS) < 16
    client = OpenAI(base_url=base_url, api_key=api_key, default_headers={"X-Session-Id": session_id}, max_retries=0)
    messages = list(prompt)
    for k in range(2):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=[schema], max_tokens=12, extra_body={"return_token_ids": True}
        )
        choice, extra = reply.choices[0], reply.choices[0].model_extra
        ASYNC_RECORDED.setdefault(session_id, []).append(
            (reply.model_extra["prompt_token_ids"], extra["completion_token_ids"], extra["completion_logprobs"], extra["weight_version"])
        )
        messages.append(choice.message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": run_tool(c)} for c in choice.message.tool_calls or []]
        if k == 0 and second_batch:
            FIRST_CALLS.set()
            REFITTED.wait(30)
    return messages


AGENT_RUN = (
    f"env.tool.agent={THIS}:recording_agent",
    "env.tool.deadline_s=6.0",  # the hung agent waits 30 s; the others take ~1 s (up to ~4 s on a loaded 2-core CI machine)
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_num_steps=2",
    "grpo.val_at_start=false",
    "grpo.val_period=2",
    "grpo.max_val_samples=4",
    "policy.train_micro_batch_size=8",
    "policy.num_cpus_per_worker=0.25",
    "data.train.num_problems=256",
    "logger.dump_train_data=true",
    "logger.plot_at_end=false",
    "logger.progress_bar=false",
)


def test_agent_run_trains_on_the_served_tokens_and_survives_failing_agents(ray_cluster, tmp_path, capfd, monkeypatch):
    recorded = import_object(f"{THIS}:recording_agent").__globals__["RECORDED"]  # the module the run imports
    history = train(load_config(RECIPE, [*AGENT_RUN, f"logger.log_dir={tmp_path / 'sync'}"]))
    steps = [r for r in history if "train/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # every step: 8 sessions, one raised, one hung past its deadline; the run went on
        assert r["agent/sessions"] == 8 and r["agent/failures/error"] == 1 and r["agent/failures/deadline"] >= 1
        assert r["agent/rows_per_session"] == 1 and r["agent/branched_sessions"] == 0
        assert r["train/gen_kl"] < 1e-6  # the training pass's logprobs of the served tokens are the server's
    assert "validation/accuracy" in read_metrics(tmp_path / "sync")[-1]
    report = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[agent]")]
    assert len(report) >= 2 and all("error x1 (first: RuntimeError: a bug in the agent)" in line for line in report[:2])
    served: dict[tuple[int, ...], list[list[float]]] = {}  # one response can be served twice (the same prompt and draw)
    for calls in recorded.values():
        response, logprobs = expected_row(calls)
        served.setdefault(response, []).append(logprobs)
    tokenizer = load_tokenizer(load_config(RECIPE).policy.model_name)
    for step in (1, 2):
        rows = read_jsonl(tmp_path / "sync" / f"train_data_step{step}.jsonl")
        assert len(rows) == 8
        for row in rows:
            # The row is the served calls: the first prompt's continuation, with exactly the sampled ids trained ...
            gen, prev = torch.tensor(row["generation_logprobs"]), torch.tensor(row["prev_logprobs"])
            # ... with the server's logprobs (of one of the sessions that drew it: batches round differently) ...
            assert any(gen.tolist() == pytest.approx(lps, abs=1e-7) for lps in served[tuple(row["response_token_ids"])])
            assert torch.allclose(prev, gen, atol=1e-5)  # ... which the training pass reproduces
            # The dump says which tokens were sampled (the columns were multi-turn only) and shows them, beside the answer
            mask = row["response_mask"]
            assert len(mask) == len(row["response_token_ids"]) and sum(mask) == len(gen) and row["num_turns"] >= 1
            assert row["response"] == tokenizer.decode(row["response_token_ids"], skip_special_tokens=False) and "answer" in row
        assert sum(row["reward"] == 0.0 for row in rows) >= 2  # the raising and the hung session: failure_reward 0
    # The same agent task in an async run, on this cluster and its actors (one test: the suite's time).
    check_async_agent_run(tmp_path / "async", monkeypatch)


def expected_row(calls: list[tuple]) -> tuple[tuple[int, ...], list[float]]:
    """A one-row session's response ids (everything after the first prompt) and the logprobs of its sampled ids."""
    ids, logprobs = list(calls[0][0]), []
    for prompt, completion, lps in calls:
        assert prompt[: len(ids)] == ids  # every call extends the previous one (the tiny template keeps history)
        ids = list(prompt) + list(completion)
        logprobs += lps
    return tuple(ids[len(calls[0][0]) :]), logprobs


def forced_refit(refit):
    """``AsyncRollouts.refit``, waiting first for a call of a step-2 session (made with v0), and announcing it is done."""

    def wrapped(self):
        FIRST_CALLS.wait(30)
        timing = refit(self)
        REFITTED.set()
        return timing

    return wrapped


def check_async_agent_run(log_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Async (at most 1 update old) on the same cluster: the rows are the served calls, every row's age counts from its
    session's first call and is within the bound, sessions whose calls span the forced refit are trained as one row
    with their first call's version, and the run leaves no thread behind."""
    module = import_object(f"{THIS}:spanning_agent").__globals__  # the module the run imports (its events)
    recorded = module["ASYNC_RECORDED"]
    monkeypatch.setattr(AsyncRollouts, "refit", module["forced_refit"](AsyncRollouts.refit))
    before = set(threading.enumerate())  # (the sync run's hung agent may still be sleeping)
    overrides = [o for o in AGENT_RUN if not o.startswith(("env.tool.agent", "env.tool.deadline_s", "grpo.val_period"))]
    history = train(
        load_config(
            RECIPE,
            [
                *overrides,
                f"env.tool.agent={THIS}:spanning_agent",
                "grpo.async_grpo.enabled=true",
                "grpo.async_grpo.max_trajectory_age_steps=1",
                "loss_fn.use_importance_sampling_correction=true",
                "grpo.val_period=0",
                "grpo.val_at_end=false",
                "policy.num_threads_per_worker=auto",
                f"logger.log_dir={log_dir}",
            ],
        )
    )
    assert module["REFITTED"].is_set()
    steps = {r["step"]: r for r in history if "train/reward" in r}
    assert list(steps) == [1, 2] and steps[1]["train/max_trajectory_age"] == 0.0 and steps[2]["train/max_trajectory_age"] == 1.0
    assert steps[2]["agent/sessions_across_refits"] >= 1 and steps[2]["async/refitted_mid_sequence_fraction"] > 0
    assert all(r["agent/sessions"] == 8 and r["agent/failures/deadline"] == 0 for r in steps.values())
    sessions = {}
    for calls in recorded.values():
        response, logprobs = expected_row([c[:3] for c in calls])
        versions = [c[3] for c in calls for _ in c[1]]  # the weight version of every sampled token
        sessions.setdefault(response, []).append((logprobs, versions))
    spanning = 0
    for step in (1, 2):
        for row in read_jsonl(log_dir / f"train_data_step{step}.jsonl"):
            gen, prev = torch.tensor(row["generation_logprobs"]), torch.tensor(row["prev_logprobs"])
            matches = [v for lps, v in sessions[tuple(row["response_token_ids"])] if gen.tolist() == pytest.approx(lps, abs=1e-7)]
            assert matches, "a trained row that is not a served session"
            versions = matches[0]
            assert 0 <= (step - 1) - versions[0] <= 1  # the age counts from the session's first call, within the bound
            spanning += len(set(versions)) > 1
            current = torch.tensor([v == step - 1 for v in versions])  # tokens sampled by the weights being trained
            assert torch.allclose(prev[current], gen[current], atol=1e-5)  # ... whose logprobs the training pass reproduces
    assert spanning >= 1  # a row sampled by two versions, trained with its first call's (age 1 at step 2)
    names = {"trajectory-collector", "rollout-server", "rollout-server-engine", "agent-session"}
    left = [t.name for t in set(threading.enumerate()) - before if t.name in names]
    assert not left, f"threads left after the run: {left}"


def test_nemo_like_eval_rolls_agent_tasks_out_through_their_agents(ray_cluster, tmp_path):
    """`nemo-like eval` on an agent recipe sampled the bare model for one turn and scored that (0.0 accuracy on the
    demo, whose agent calls the calculator): it must run each sample's session through the recipe's agent."""
    from nemo_like.evaluation.run import evaluate

    # in two chunks of 2 prompts (4 sessions): their sessions and prompts are counted from the eval's first
    cfg = load_config(
        RECIPE, ["grpo.max_val_samples=4", "eval.num_samples_per_prompt=2", f"eval.output_dir={tmp_path}", "eval.samples_per_chunk=5"]
    )
    summary = evaluate(cfg)
    metrics = summary["env_metrics"]
    assert metrics["agent/sessions"] == 8 and metrics["agent/failures"] == 0 and metrics["agent/calls_per_session"] >= 1
    rows = read_jsonl(tmp_path / "results.jsonl")
    assert len(rows) == 8 and summary["accuracy_per_task"].keys() == {"tool"}
    # Each row names its session; sample_index numbers a prompt's sessions (not its rows), and the summary counts sessions.
    sessions = {(r["prompt_index"], r["session"]): r["sample_index"] for r in rows}
    assert len(sessions) == 8 and sorted(sessions.values()) == [0, 0, 0, 0, 1, 1, 1, 1] and summary["num_rows"] == 8
    assert {r["session"] for r in rows} == set(range(8)) and {r["prompt_index"] for r in rows} == {0, 1, 2, 3}
    assert metrics["agent/rows_per_session"] == summary["num_rows"] / 8  # a mean over both chunks' sessions, not their sum
    assert summary["checkpoint_dir"] is None and summary["seed"] == cfg.grpo.seed  # the embedded model: no directory


def test_a_rollout_server_that_fails_to_start_releases_every_actor_set_up_started(ray_cluster, tmp_path, monkeypatch):
    """The rollout server starts after the policy, engine and environment actors: a failure there (a server not up in
    time, say) left every actor and placement group alive, and a sweep's next run in the process short of CPUs."""
    import time

    import ray

    from nemo_like.algorithms import setup
    from nemo_like.distributed import worker_group

    def server_fails(*args, **kwargs):
        raise RuntimeError("the rollout server did not come up")

    cfg = load_config(RECIPE, [*AGENT_RUN, f"logger.log_dir={tmp_path / 'logs'}"])
    worker_group._POOL.evict()  # the session keeps released groups idle for the next run: count only what leaked
    before = ray.available_resources().get("CPU", 0.0)
    monkeypatch.setattr(setup, "start_agent_rollouts", server_fails)
    with pytest.raises(RuntimeError, match="did not come up"):
        setup.setup_grpo(cfg)
    worker_group._POOL.evict()
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0.0) < before and time.monotonic() < deadline:
        time.sleep(0.2)  # placement groups are removed asynchronously
    assert ray.available_resources().get("CPU", 0.0) >= before
