"""The server's parts on the shipped tokenizer: tool-call parsing (a plug-in), prompt ids that reuse sampled ids,
message rendering, and request checks."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from nemo_like.models.loading import load_tokenizer
from nemo_like.serving.continuation import Continuations, message_key
from nemo_like.serving.errors import ServingError
from nemo_like.serving.protocol import ChatCompletionRequest, CompletionRequest
from nemo_like.serving.rendering import Renderer
from nemo_like.serving.server import is_loopback
from nemo_like.serving.tool_parsers import TOOL_PARSERS, parse_hermes


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(load_tokenizer("embedded:tiny-tool-qwen2"))


def test_hermes_markup_becomes_openai_tool_calls_and_malformed_markup_stays_text():
    parsed = parse_hermes('Let me see.<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>')
    assert parsed.content == "Let me see."
    (tool_call,) = parsed.tool_calls
    assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")
    assert tool_call["function"] == {"name": "calculator", "arguments": json.dumps({"expression": "2*3"})}
    broken = '<tool_call>{"name": "calculator", "arguments": </tool_call>'
    assert parse_hermes(broken).content == broken and parse_hermes(broken).tool_calls == []
    assert TOOL_PARSERS.get("hermes") is parse_hermes and "none" in TOOL_PARSERS


def test_a_rendering_that_extends_an_earlier_completion_reuses_its_ids(renderer):
    continuations = Continuations()
    text = "<|im_start|>user\nhi<|im_end|><|im_start|>assistant\n"
    sampled = [57, 74, 67, 86, 2]  # "What" spelled letter by letter: the tokenizer encodes the text as one token
    sampled_text = renderer.decode(sampled)
    assert renderer.tokenize(sampled_text) != sampled
    continuations.add(text + sampled_text, renderer.tokenize(text) + sampled)
    follow = text + sampled_text + "<|im_start|>tool\n7<|im_end|><|im_start|>assistant\n"
    ids = continuations.prompt_ids(follow, renderer.tokenize)
    assert ids[: len(renderer.tokenize(text)) + 5] == renderer.tokenize(text) + sampled
    assert renderer.decode(ids) == follow
    assert continuations.prompt_ids("other", renderer.tokenize) == renderer.tokenize("other")


def test_a_returned_message_renders_as_the_raw_sampled_text(renderer):
    continuations = Continuations()
    calls = [{"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}]
    raw = '<tool_call>{"name":"calculator","arguments":{"expression":"2*3"}}</tool_call>'
    continuations.remember_message(message_key(None, calls), raw)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    assert raw in renderer.chat_text(messages, None, continuations)
    assert raw not in renderer.chat_text(messages, None, Continuations())  # an unknown message is rendered as sent


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}], "messages[0].tool_calls"),
    ],
)
def test_malformed_messages_are_400_naming_the_message(renderer, messages, param):
    with pytest.raises(ServingError) as error:
        renderer.chat_text(messages, None, None)
    assert error.value.status == 400 and error.value.param == param


def test_request_checks_and_sampling_settings():
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], temperature=0, top_k=-1, stop="x")
    params = chat.sampling_params(max_new_tokens=8)
    assert params.greedy and params.top_k is None and params.stop_strings == ("x",) and params.max_new_tokens == 8
    for fields, param in [
        ({"stream": True}, "stream"),
        ({"logit_bias": {"1": 2.0}}, "logit_bias"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]:
        with pytest.raises(ServingError) as error:
            ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], **fields).check_supported()
        assert error.value.param == param and error.value.code == "unsupported_parameter"
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], frobnicate=1)
    assert CompletionRequest(model="m", prompt=[1, 2]).requested_max_tokens() == 16


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")
