"""The shipped tiny tool model (nemo_like/assets/tiny-tool-qwen2): its tokenizer keeps the call markup whole and
its template never rewrites earlier turns, and greedy decoding solves held-out products through the real
calculator (two turns against ToolEnvironment)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_like.config import ConfigError
from nemo_like.data.multiturn_tasks import make_multiply_problems
from nemo_like.environments.tools.environment import ToolEnvironment
from nemo_like.models.assets import embedded_model_path
from nemo_like.models.loading import check_model_source

PATH = embedded_model_path("embedded:tiny-tool-qwen2")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(PATH)


def test_call_markup_is_whole_tokens_and_the_template_is_prefix_stable(tok) -> None:
    for piece in ("<tool_call>", "</tool_call>", '{"name": "calculator", "arguments": {"expression": "', '"}}'):
        assert len(tok.encode(piece, add_special_tokens=False)) == 1
    conversation = [{"role": "user", "content": "What is 347 times 28?"}]
    turns = [
        {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "347*28"}}</tool_call>'},
        {"role": "tool", "content": "9716"},
        {"role": "assistant", "content": "9716"},
    ]
    for turn in turns:
        before = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=turn["role"] == "assistant")
        conversation.append(turn)
        assert tok.apply_chat_template(conversation, tokenize=False).startswith(before)


def test_greedy_two_turn_episodes_solve_held_out_products_with_the_calculator(tok) -> None:
    model = AutoModelForCausalLM.from_pretrained(PATH).eval()
    env = ToolEnvironment(tools=["calculator"])
    problems = make_multiply_problems(8, 99, "validation")
    logs = [[{"role": "user", "content": p["problem"]}] for p in problems]
    for _ in range(2):
        texts = tok.apply_chat_template(logs, add_generation_prompt=True, tokenize=False)
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=16, do_sample=False)
        for log, text in zip(logs, tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)):
            log.append({"role": "assistant", "content": text})
        steps = env.step(logs, [{"answer": p["answer"]} for p in problems])
        for log, step in zip(logs, steps):
            if step.observation is not None:
                log.append(step.observation)
    counts = env.metrics()
    assert counts["samples_using_tool"] == 8 and counts["tool_errors"] == 0  # greedy always calls the calculator
    assert counts["correct"] >= 6  # the build measured 0.95 on 256 held-out problems


def test_unknown_embedded_models_fail_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="policy.model_name: 'embedded:nope' is not a shipped model; shipped: embedded:tiny-arith"):
        check_model_source("embedded:nope", "policy.model_name")
    check_model_source("embedded:tiny-tool-qwen2", "policy.model_name")
