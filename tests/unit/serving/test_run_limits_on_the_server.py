"""What a run hands its rollout server, and what the server makes of a call, against the real server (the real
``openai`` client and httpx) over the shipped tokenizer and a scripted engine: the run's stop tokens, stop strings
and ``max_new_tokens``; session token budgets under ``n`` > 1 and concurrent calls, and how the run classifies a
session the budget refused; agent return values (text parts, numpy / torch scalars); the ``num_calls`` and
``rows_per_session`` counters; ``n: null`` and the ``param`` of a union field; logprob ``bytes`` of tokens holding
part of a character; greedy validation / eval sessions of agent tasks."""

from __future__ import annotations

import fractions
import threading
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import LlamaTokenizer

from nemo_like.config import load_config
from nemo_like.data.prompts import PromptRecord
from nemo_like.environments.agent import AgentConfig, AgentSettings, final_answer
from nemo_like.environments.arithmetic import ArithmeticEnvironment
from nemo_like.experience.agent_rollouts import AgentHandles, outcome_of, start_agent_rollouts
from nemo_like.experience.rollouts import collect_rollout
from nemo_like.models.generation.interface import GeneratedSample, sampling_params
from nemo_like.models.loading import load_tokenizer
from nemo_like.serving.rendering import Renderer
from nemo_like.serving.server import RolloutServer, ServerConfig
from nemo_like.serving.service import run_sampling
from nemo_like.serving.trajectory import rows_for_training

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_agent_tiny_cpu.yaml"
SENTENCEPIECE = Path(__file__).resolve().parents[2] / "fixtures" / "tiny_sentencepiece"
TOKENIZER = load_tokenizer("embedded:tiny-tool-qwen2")
EOS = TOKENIZER.eos_token_id
STOP_ID = TOKENIZER("!", add_special_tokens=False)["input_ids"][0]  # an ordinary token as the run's stop token
USER = [{"role": "user", "content": "hi"}]


def ids_of(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


class Scripted:
    """An engine that samples ``script(prompt)`` (eos ends it, ``max_new_tokens`` cuts it; it does not stop at the
    params' stop tokens itself, so the server's own cut is tested too) and keeps every call's params. ``entered`` /
    ``proceed``: with ``block``, each call waits for ``proceed`` after setting ``entered``."""

    PER_PROMPT_SEEDS = True

    def __init__(self, script, block: bool = False) -> None:
        self.script, self.block, self.weight_version = script, block, 0
        self.logprob = -0.5  # every token's (a positive one makes the session's records fail their checks)
        self.params: list = []
        self.entered, self.proceed = threading.Event(), threading.Event()

    def generate(self, prompts, params, seed) -> list[GeneratedSample]:
        self.params.append(params)
        if self.block:
            self.entered.set()
            assert self.proceed.wait(30)
        samples = []
        for prompt in prompts:
            ids, truncated = list(self.script(prompt)), True
            if EOS in ids:
                ids, truncated = ids[: ids.index(EOS) + 1], False
            if len(ids) > params.max_new_tokens:
                ids, truncated = ids[: params.max_new_tokens], True
            samples.append(GeneratedSample(list(prompt), ids, [self.logprob] * len(ids), truncated, 0, 0))
        return samples


def recipe(*overrides: str):
    return load_config(RECIPE, ["policy.generation.max_new_tokens=32", *overrides])


def client(server, session_id: str | None = None) -> openai.OpenAI:
    headers = {"X-Session-Id": session_id} if session_id else None
    return openai.OpenAI(base_url=server.base_url, api_key=server.api_key, default_headers=headers, max_retries=0)


def chat(server, session_id: str | None = None, **fields):
    return client(server, session_id).chat.completions.create(
        model="policy", messages=fields.pop("messages", USER), extra_body={"return_token_ids": True}, **fields
    )


def training_server(engine: Scripted, *overrides: str, settings=None):
    """The rollout server exactly as a training run starts it (and its :class:`AgentRollouts`)."""
    return start_agent_rollouts(recipe(*overrides), TOKENIZER, engine, [EOS], settings or {})


# 1. The run's stop tokens, stop strings and max_new_tokens -------------------------------------------------------------


def test_a_training_runs_server_stops_at_the_runs_stop_tokens_and_strings_and_caps_at_max_new_tokens():
    engine = Scripted(lambda prompt: ids_of("ab") + [STOP_ID] + ids_of("cd STOP ef") + [EOS])
    agents = training_server(engine, f"policy.generation.stop_token_ids=[{STOP_ID}]", "policy.generation.stop_strings=[STOP]")
    server = agents.server
    try:
        sid = server.sessions.open(metadata={"seed": 1})
        reply = chat(server, sid)  # no max_tokens: the run's max_new_tokens, not the rest of the context
        params = engine.params[-1]
        assert params.stop_token_ids == (STOP_ID,) and params.stop_strings == ("STOP",) and params.max_new_tokens == 32
        (choice,) = reply.choices
        assert choice.message.content == "ab" and choice.finish_reason == "stop"  # the stop token ends it, as eos does
        assert choice.model_extra["completion_token_ids"] == ids_of("ab") + [STOP_ID]  # recorded with it, as eos is
        engine.script = lambda prompt: ids_of("hi STOP there zz") + [EOS]
        reply = chat(server, sid, stop=["zz"], max_tokens=60)  # a request's stop strings join the run's
        assert engine.params[-1].stop_strings == ("zz", "STOP") and engine.params[-1].max_new_tokens == 32
        assert reply.choices[0].message.content == "hi " and reply.choices[0].finish_reason == "stop"
        engine.script = lambda prompt: ids_of("x" * 50)
        reply = chat(server, sid, max_tokens=60)  # capped at policy.generation.max_new_tokens
        assert reply.usage.completion_tokens == 32 and reply.choices[0].finish_reason == "length"
        reply = chat(server, sid, max_tokens=10**6)  # far past the context: capped first, then it fits (it was a 400)
        assert reply.usage.completion_tokens == 32 and engine.params[-1].max_new_tokens == 32
        result = server.sessions.end(sid)
        assert result.rejected is None
        # performance/num_generated_tokens counts what the engine decoded, the tails past the server's cuts too
        decoded = len(ids_of("ab") + [STOP_ID] + ids_of("cd STOP ef") + [EOS]) + len(ids_of("hi STOP there zz") + [EOS]) + 32 + 32
        kept = sum(sum(row.response_mask) for row in result.rows)
        assert result.decoded_tokens == decoded > kept
        assert sum(s.num_decoded_tokens for s in rows_for_training([result]).samples) == decoded
    finally:
        server.stop()


def test_a_turn_ended_by_a_run_stop_token_renders_back_with_it_and_the_session_stays_one_row():
    """The run's stop token is recorded and kept out of the returned text, but it is what the model wrote: the history
    the next call renders holds it (only eos is written back by the template). It was dropped with eos, so the next
    prompt no longer extended the recorded ids and every such turn branched."""
    engine = Scripted(lambda prompt: ids_of("ab") + [STOP_ID])
    agents = training_server(engine, f"policy.generation.stop_token_ids=[{STOP_ID}]")
    server = agents.server
    try:
        sid = server.sessions.open(metadata={"seed": 1})
        first = chat(server, sid)
        assert first.choices[0].message.content == "ab"
        history = [*USER, {"role": "assistant", "content": "ab"}, {"role": "user", "content": "more"}]
        second = chat(server, sid, messages=history)
        before = first.prompt_token_ids + first.choices[0].model_extra["completion_token_ids"]
        assert second.prompt_token_ids[: len(before)] == before
        result = server.sessions.end(sid, 1.0)
        assert (len(result.rows), result.branched) == (1, False)
    finally:
        server.stop()


def test_a_run_stop_token_that_is_the_templates_own_end_of_turn_is_written_back_once():
    """A base model's eos (<|endoftext|>) with the template's <|im_end|> as the run's stop token: kept like any stop
    token, the next prompt held <|im_end|><|im_end|> (the template writes its own), a context the model never sees."""
    im_end, endoftext = TOKENIZER.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    engine = Scripted(lambda prompt: ids_of("ab") + [im_end])
    agents = start_agent_rollouts(recipe(f"policy.generation.stop_token_ids=[{im_end}]"), TOKENIZER, engine, [endoftext], {})
    server = agents.server
    try:
        sid = server.sessions.open(metadata={"seed": 1})
        first = chat(server, sid)
        history = [*USER, {"role": "assistant", "content": "ab"}, {"role": "user", "content": "more"}]
        second = chat(server, sid, messages=history)
        assert "<|im_end|><|im_end|>" not in TOKENIZER.decode(second.prompt_token_ids)
        before = first.prompt_token_ids + first.choices[0].model_extra["completion_token_ids"]
        assert second.prompt_token_ids[: len(before)] == before
        assert (len(server.sessions.end(sid, 1.0).rows), server.service.renderer.turn_end_id) == (1, im_end)
    finally:
        server.stop()


def test_nemo_like_serve_takes_max_new_tokens_as_the_default_of_a_call_without_max_tokens():
    engine = Scripted(lambda prompt: ids_of("x" * 50))
    sampling = run_sampling(recipe(f"policy.generation.stop_token_ids=[{STOP_ID}]").policy.generation, enforce=False)
    with RolloutServer(engine, TOKENIZER, ServerConfig(max_context=512, run_sampling=sampling), [EOS]) as server:
        assert chat(server).usage.completion_tokens == 32
        assert chat(server, max_tokens=40).usage.completion_tokens == 40  # not a cap: an agent may ask for more
        assert engine.params[-1].stop_token_ids == (STOP_ID,)


def test_a_server_on_vllm_refuses_a_temperature_vllm_would_raise():
    """vLLM samples a positive temperature below 0.01 at 0.01 (a warning below its log level): a request at 0.002 got
    T=0.01 tokens and logprobs, silently. Such a server refuses it; 0 (greedy) and 0.01 pass."""
    from nemo_like.models.generation.vllm import VLLMGeneration

    engine = Scripted(lambda prompt: ids_of("x"))
    engine.MIN_TEMPERATURE = VLLMGeneration.MIN_TEMPERATURE
    with RolloutServer(engine, TOKENIZER, ServerConfig(max_context=512), [EOS]) as server:
        with pytest.raises(openai.BadRequestError) as refused:
            chat(server, temperature=0.002)
        assert refused.value.body["param"] == "temperature" and "below 0.01" in refused.value.body["message"]
        chat(server, temperature=0.0)
        chat(server, temperature=0.01)
        assert [p.greedy for p in engine.params] == [True, False] and engine.params[-1].temperature == 0.01


# 2. Session budgets --------------------------------------------------------------------------------------------------


def budget_server(engine: Scripted) -> RolloutServer:
    return RolloutServer(engine, TOKENIZER, ServerConfig(max_context=512), [EOS]).start()


def test_a_call_with_n_choices_never_samples_past_the_sessions_budget():
    with budget_server(Scripted(lambda prompt: ids_of("x" * 20))) as server:
        sid = server.sessions.open(metadata={"token_budget": 5})
        assert chat(server, sid, max_tokens=4).usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError) as refused:  # 1 token left, 4 choices: refused, not 4 tokens sampled
            chat(server, sid, n=4)
        body = refused.value.body
        assert refused.value.code == "session_budget_exceeded" and body["param"] == "n" and "1 are left" in body["message"]
        assert server.sessions.session(sid).sampled_tokens == 4
        reply = chat(server, sid)  # one choice: the last token, cut there
        assert reply.usage.completion_tokens == 1 and reply.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as spent:
            chat(server, sid)
        assert spent.value.code == "session_budget_exceeded" and spent.value.body["param"] == "max_tokens"
        other = server.sessions.open(metadata={"token_budget": 9})
        assert [len(c.model_extra["completion_token_ids"]) for c in chat(server, other, n=2).choices] == [4, 4]
        assert server.sessions.end(other).num_calls == 1 and server.sessions.end(sid).num_calls == 2


def test_concurrent_calls_reserve_their_tokens_and_give_back_what_they_did_not_sample():
    engine = Scripted(lambda prompt: ids_of("x" * 20), block=True)
    with budget_server(engine) as server:
        sid = server.sessions.open(metadata={"token_budget": 10})
        first: list = []
        thread = threading.Thread(target=lambda: first.append(chat(server, sid)))
        thread.start()
        assert engine.entered.wait(30)  # the first call is sampling: its 10 tokens are reserved
        with pytest.raises(openai.BadRequestError) as refused:
            chat(server, sid)
        assert refused.value.code == "session_budget_exceeded" and "10 more reserved" in refused.value.body["message"]
        engine.proceed.set()
        thread.join(30)
        assert first[0].usage.completion_tokens == 10 and server.sessions.session(sid).sampled_tokens == 10
        engine.block = False
        short = server.sessions.open(metadata={"token_budget": 10})
        engine.script = lambda prompt: ids_of("xyz") + [EOS]
        assert chat(server, short).usage.completion_tokens == 4  # reserved 10, sampled 4: 6 given back
        assert chat(server, short).usage.completion_tokens == 4 and server.sessions.session(short).reserved_tokens == 0


def agent_batch(agent, budget: int, logprob: float = -0.5) -> tuple:
    """One session of ``agent`` (a sync agent function) in a training run's server with ``max_tokens_per_session``
    ``budget``: the batch's rollout and the engine (its tokens' ``logprob``)."""
    engine = Scripted(lambda prompt: ids_of("x" * 20))
    engine.logprob = logprob
    settings = {"tool": AgentSettings("tool", AgentConfig(agent="x:y", max_tokens_per_session=budget, deadline_s=60), agent)}
    agents = training_server(engine, settings=settings)
    try:
        prompt = PromptRecord("p", USER, ids_of("hi"), {"task_name": "tool"})
        handles = AgentHandles({"tool": []}, agents)
        return collect_rollout(None, handles, TOKENIZER, [prompt], 1, sampling_params(recipe()), seed=0), engine
    finally:
        agents.close(join_s=5)
        agents.server.stop()


def budget_agent(catch: bool):
    def agent(base_url, api_key, session_id, prompt, metadata):
        c = openai.OpenAI(base_url=base_url, api_key=api_key, default_headers={"X-Session-Id": session_id}, max_retries=0)
        c.chat.completions.create(model="policy", messages=prompt, max_tokens=4)
        try:
            c.chat.completions.create(model="policy", messages=prompt, n=4)
        except openai.BadRequestError:
            if not catch:
                raise
        return 1.0

    return agent


def test_a_session_fails_budget_only_when_its_agent_raised_after_a_budget_refusal():
    rollout, _ = agent_batch(budget_agent(catch=True), budget=5)  # the agent handled the refusal: a reward of its own
    assert rollout.env_metrics["agent/failures"] == 0 and rollout.rewards.tolist() == [1.0]
    assert sum(sum(s.response_mask) for s in rollout.samples) == 4  # never past the budget
    rollout, _ = agent_batch(budget_agent(catch=False), budget=5)
    assert rollout.env_metrics["agent/failures/budget"] == 1 and rollout.rewards.tolist() == [0.0]
    rollout, _ = agent_batch(budget_agent(catch=True), budget=5, logprob=0.5)  # its records fail: rejected, no rows
    (placeholder,) = rollout.samples
    assert rollout.env_metrics["agent/failures/rejected"] == 1 and placeholder.num_sampled_tokens == 0
    assert rollout.decoded_tokens == 4  # the engine decoded its one call all the same (num_generated_tokens)


# 3. Agent return values ----------------------------------------------------------------------------------------------


def test_an_answer_in_text_parts_is_joined_and_numpy_and_torch_scalars_are_rewards():
    parts = [
        {"role": "user", "content": "7*8?"},
        {"role": "assistant", "content": [{"type": "text", "text": "5"}, {"type": "text", "text": "6"}]},
    ]
    assert final_answer(parts) == "56" and outcome_of(parts, True).answer == "56"
    assert ArithmeticEnvironment().score([outcome_of(parts, True).answer], [{"answer": 56}]) == [1.0]
    image = [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert outcome_of(image, True).failure == "bad_return" and "text content parts" in outcome_of(image, True).detail
    for value, reward in [
        (np.float32(0.5), 0.5), (np.int64(2), 2.0), (np.float64(0.25), 0.25), (np.array(0.75), 0.75),
        (torch.tensor(1.5), 1.5), (torch.tensor(3), 3.0), (fractions.Fraction(1, 4), 0.25),
    ]:  # fmt: skip
        outcome = outcome_of(value, False)
        assert outcome.reward == reward and isinstance(outcome.reward, float) and outcome.failure is None, value
    for value in [
        np.float32("nan"),
        torch.tensor(float("inf")),
        torch.tensor([1.0]),
        np.array([1.0, 2.0]),
        np.bool_(True),
        torch.tensor(True),
    ]:
        assert outcome_of(value, False).failure == "bad_return", value
    assert "shape (1,)" in outcome_of(torch.tensor([1.0]), False).detail


# 4. Counters ---------------------------------------------------------------------------------------------------------


def test_a_call_with_n_choices_counts_as_one_call():
    with budget_server(Scripted(lambda prompt: ids_of("ab") + [EOS])) as server:
        sid = server.sessions.open()
        chat(server, sid, n=3)
        chat(server, sid)
        headers = {"Authorization": f"Bearer {server.api_key}"}
        ended = httpx.post(f"{server.base_url}/sessions/{sid}/end", headers=headers, json={"reward": 1.0}).json()
        assert ended["num_calls"] == 2 and ended["rows"] == 4  # each choice of n, and the second call, is a row
        assert server.sessions.metrics()["agent/calls_per_session"] == 2.0


# 5. Request validation -----------------------------------------------------------------------------------------------


def test_null_n_is_one_and_a_union_fields_param_is_the_field():
    with budget_server(Scripted(lambda prompt: ids_of("ab") + [EOS])) as server:
        headers = {"Authorization": f"Bearer {server.api_key}"}
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as http:
            reply = http.post("/chat/completions", json={"model": "policy", "messages": USER, "n": None})
            assert reply.status_code == 200 and len(reply.json()["choices"]) == 1
            for path, body, param in [
                ("/completions", {"prompt": ["a", "b"]}, "prompt"),
                ("/completions", {"prompt": [1, 2], "stop": 5}, "stop"),
                ("/chat/completions", {"messages": USER, "tool_choice": 3}, "tool_choice"),
                ("/chat/completions", {"messages": [USER[0], 7]}, "messages[1]"),
            ]:
                error = http.post(path, json={"model": "policy", **body}).json()["error"]
                assert error["param"] == param and f"'{param}'" in error["message"], (body, error)


# 6. Logprob bytes ----------------------------------------------------------------------------------------------------


def test_the_logprob_bytes_of_tokens_that_split_a_character_join_to_the_text():
    text = "é✓ ok"
    with budget_server(Scripted(lambda prompt: ids_of(text) + [EOS])) as server:
        entries = chat(server, logprobs=True).choices[0].logprobs.content
        assert len(entries) == len(ids_of(text)) + 1
        assert b"".join(bytes(e.bytes) for e in entries[:-1]).decode() == text
        assert bytes(entries[-1].bytes).decode() == "<|im_end|>"
    sentencepiece = LlamaTokenizer.from_pretrained(SENTENCEPIECE, add_bos_token=False, legacy=False, pad_token="<pad>")
    renderer = Renderer(sentencepiece, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ids = sentencepiece(text, add_special_tokens=False)["input_ids"]  # byte-fallback pieces: <0xC3> <0xA9> ...
    assert b"".join(renderer.token_bytes(t) for t in ids).decode() == renderer.decode_continuation(ids) == " " + text


# 7. Greedy validation / eval of agent tasks ---------------------------------------------------------------------------


def test_greedy_validation_sessions_of_agent_tasks_decode_greedily():
    sent: list = []

    def agent(base_url, api_key, session_id, prompt, metadata):
        c = openai.OpenAI(base_url=base_url, api_key=api_key, default_headers={"X-Session-Id": session_id}, max_retries=0)
        c.chat.completions.create(model="policy", messages=prompt, max_tokens=4)  # temperature unset
        c.chat.completions.create(model="policy", messages=prompt, max_tokens=4, temperature=1.0)  # the run's, as sent in training
        try:
            c.chat.completions.create(model="policy", messages=prompt, max_tokens=4, temperature=0.7)
        except openai.BadRequestError as exc:
            sent.append(exc.code)
        return 1.0

    engine = Scripted(lambda prompt: ids_of("x" * 20))
    settings = {"tool": AgentSettings("tool", AgentConfig(agent="x:y", deadline_s=60), agent)}
    agents = training_server(engine, settings=settings)
    try:
        prompt = PromptRecord("p", USER, ids_of("hi"), {"task_name": "tool"})
        handles = AgentHandles({"tool": []}, agents)
        for greedy in (True, False):
            engine.params.clear()
            rollout = collect_rollout(None, handles, TOKENIZER, [prompt], 2, sampling_params(recipe(), greedy=greedy), seed=0)
            assert rollout.env_metrics["agent/failures"] == 0
            assert [p.greedy for p in engine.params] == [greedy] * len(engine.params) and len(engine.params) >= 2
        assert sent == ["sampling_mismatch"] * 4  # another temperature is still refused
    finally:
        agents.close(join_s=5)
        agents.server.stop()
