"""A GRPO run through a user's agent (issue 29), end to end: real Ray actors, the shipped tiny tool model, the rollout
server on 127.0.0.1, the real ``openai`` client over real HTTP. The agent below is named in the recipe by this file's
path; the run imports it (the same module object as ``import_object`` returns here), so what it records is readable
from the test."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
import torch
from functional.helpers import read_jsonl, read_metrics

from nemo_like.config import load_config
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


AGENT_RUN = (
    f"env.tool.agent={THIS}:recording_agent",
    "env.tool.deadline_s=4.0",
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


def test_agent_run_trains_on_the_served_tokens_and_survives_failing_agents(ray_cluster, tmp_path, capfd):
    recorded = import_object(f"{THIS}:recording_agent").__globals__["RECORDED"]  # the module the run imports
    history = train(load_config(RECIPE, [*AGENT_RUN, f"logger.log_dir={tmp_path}"]))
    steps = [r for r in history if "train/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # every step: 8 sessions, one raised, one hung past its deadline; the run went on
        assert r["agent/sessions"] == 8 and r["agent/failures/error"] == 1 and r["agent/failures/deadline"] >= 1
        assert r["agent/rows_per_session"] == 1 and r["agent/branched_sessions"] == 0
        assert r["train/gen_kl"] < 1e-6  # the training pass's logprobs of the served tokens are the server's
    assert "validation/accuracy" in read_metrics(tmp_path)[-1]
    report = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[agent]")]
    assert len(report) >= 2 and all("error x1 (first: RuntimeError: a bug in the agent)" in line for line in report[:2])
    served = dict(expected_row(calls) for calls in recorded.values())
    for step in (1, 2):
        rows = read_jsonl(tmp_path / f"train_data_step{step}.jsonl")
        assert len(rows) == 8
        for row in rows:
            # The row is the served calls: the first prompt's continuation, with exactly the sampled ids trained ...
            logprobs = served[tuple(row["response_token_ids"])]
            gen, prev = torch.tensor(row["generation_logprobs"]), torch.tensor(row["prev_logprobs"])
            assert gen.tolist() == pytest.approx(logprobs, abs=1e-7)  # ... with the server's logprobs ...
            assert torch.allclose(prev, gen, atol=1e-5)  # ... which the training pass reproduces
        assert sum(row["reward"] == 0.0 for row in rows) >= 2  # the raising and the hung session: failure_reward 0


def expected_row(calls: list[tuple]) -> tuple[tuple[int, ...], list[float]]:
    """A one-row session's response ids (everything after the first prompt) and the logprobs of its sampled ids."""
    ids, logprobs = list(calls[0][0]), []
    for prompt, completion, lps in calls:
        assert prompt[: len(ids)] == ids  # every call extends the previous one (the tiny template keeps history)
        ids = list(prompt) + list(completion)
        logprobs += lps
    return tuple(ids[len(calls[0][0]) :]), logprobs
