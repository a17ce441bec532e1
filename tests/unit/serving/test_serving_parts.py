"""The server's parts on the shipped tokenizer: tool-call parsing (a plug-in), prompt ids that reuse sampled ids,
message rendering, and request checks."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from transformers import LlamaTokenizer, PreTrainedTokenizerFast

from nemo_like.environments.tools.parsing import ToolCallError, parse_tool_calls
from nemo_like.models.generation.interface import GeneratedSample, SamplingParams
from nemo_like.models.loading import PROBE_TOOL, load_tokenizer
from nemo_like.serving.app import EndSessionRequest, OpenSessionRequest
from nemo_like.serving.batching import GenerationQueue
from nemo_like.serving.continuation import Continuations, RawLookup, message_keys
from nemo_like.serving.errors import ServingError
from nemo_like.serving.protocol import ChatCompletionRequest, CompletionRequest
from nemo_like.serving.rendering import Renderer, direct_backend
from nemo_like.serving.responses import chat_response
from nemo_like.serving.server import is_loopback
from nemo_like.serving.service import CompletionService, Limits
from nemo_like.serving.sessions import SessionStore
from nemo_like.serving.tool_parsers import TOOL_PARSERS, ParsedTurn, parse_hermes


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
    # NaN / Infinity: Python's json reads them, no other language's parser does (the agent gets the arguments as JSON)
    for constant in ("NaN", "-Infinity"):
        nan = f'<tool_call>{{"name": "calculator", "arguments": {{"x": {constant}}}}}</tool_call>'
        assert parse_hermes(nan) == ParsedTurn(nan)
        (error,) = parse_tool_calls(nan)
        assert isinstance(error, ToolCallError) and f"{constant} is not JSON" in error.message
    # A number past a float's range: json read it as inf, and the server's json.dumps of the arguments raised (a 500
    # after the call was recorded); as a string, 1e400 stays malformed the same way
    for arguments in ('{"x": 1e400}', '"{\\"x\\": -1e400}"'):
        huge = f'<tool_call>{{"name": "calculator", "arguments": {arguments}}}</tool_call>'
        assert parse_hermes(huge) == ParsedTurn(huge)
        (error,) = parse_tool_calls(huge)
        assert isinstance(error, ToolCallError), error
    assert parse_hermes('<tool_call>{"name": "c", "arguments": {"x": 1e300}}</tool_call>').tool_calls  # in range: a call


def test_hermes_reads_a_last_call_cut_before_its_closing_tag_and_keeps_the_contents_whitespace():
    """An agent's ``stop=["</tool_call>"]`` cuts the text before the closing tag: vLLM's parser still returns the call.
    The tool environment's parser keeps calling an unclosed tag an error (a turn cut by the token limit)."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}'
    stopped = parse_hermes("Let me see.\n" + call)
    assert stopped.content == "Let me see.\n" and [c["function"]["name"] for c in stopped.tool_calls] == ["calculator"]
    two = parse_hermes(call + "</tool_call>\n" + call.replace("2*3", "4*5"))
    assert [json.loads(c["function"]["arguments"]) for c in two.tool_calls] == [{"expression": "2*3"}, {"expression": "4*5"}]
    assert two.content is None
    cut = '<tool_call>{"name": "calculator", "arguments": {"expre'  # cut by the token limit: not a call
    assert parse_hermes(cut) == ParsedTurn(cut)
    assert isinstance(parse_tool_calls(call)[0], ToolCallError)  # the tool environment stays strict


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
    continuations.remember_message(message_keys(None, calls), raw)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    assert raw in renderer.chat_text(messages, None, continuations)
    assert raw not in renderer.chat_text(messages, None, Continuations())  # an unknown message is rendered as sent
    # Its content sent back as text parts (the openai client's types allow it) is the same message: it was not found,
    # so the template's rewrite replaced the sampled text and the session branched
    said = "Let me compute."
    continuations.remember_message(message_keys(said, calls), said + raw)
    for content in (said, [{"type": "text", "text": said}]):
        sent = [messages[0], {"role": "assistant", "content": content, "tool_calls": calls}]
        assert said + raw in renderer.chat_text(sent, None, continuations), content
    # Arguments Python's json reads but the model's own parser refuses, or that overflow it: a 400 naming them (500s)
    nan_object, inf_object = {"x": float("nan")}, {"x": float("inf")}  # sent decoded (FastAPI's reader takes NaN, 1e400)
    for arguments in ("[" * 100_000 + "]" * 100_000, '{"n": ' + "9" * 5000 + "}", '{"x": NaN}', '{"x": 1e400}', nan_object, inf_object):
        bad = [{"id": "c", "type": "function", "function": {"name": "calculator", "arguments": arguments}}]
        with pytest.raises(ServingError) as error:
            renderer.chat_text([messages[0], {"role": "assistant", "content": None, "tool_calls": bad}], None, Continuations())
        assert (error.value.status, error.value.param) == (400, "messages[1].tool_calls"), str(arguments)[:20]


#: A template that renders tools and tool calls (as Qwen 2.5's does, in short).
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}{% for t in tools %}{{ t['function']['name'] }}{% endfor %}{{ '<|im_end|>' }}"
    "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}{% for c in "
    "m.get('tool_calls') or [] %}{{ '[call ' + c['function']['name'] + ']' }}{% endfor %}{{ '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_tool_calls_a_template_cannot_render_are_written_as_hermes_text(renderer, caplog):
    """A template that renders only role and content (the shipped tool model's) dropped a returned assistant's
    tool_calls outside a session's recorded history: the model no longer saw what it had asked for. They are written
    into the content as the hermes parser reads them back; a template that renders them still does; a template that
    ignores 'tools' is logged once."""
    calls = [{"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Let me compute.", "tool_calls": calls}]
    renderer = Renderer(renderer.tokenizer)  # its own: the module's may have logged already
    assert not renderer.renders_tools and not renderer.renders_tool_calls
    with caplog.at_level("WARNING", logger="nemo_like.serving"):
        text = renderer.chat_text(messages, [PROBE_TOOL], None)
        renderer.chat_text(messages, [PROBE_TOOL], None)
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = parse_hermes(turn)
    assert parsed.content == "Let me compute.\n" and json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"expression": "2*3"}
    assert [r.message.count("does not render") for r in caplog.records] == [1, 1]  # calls, tools: once each
    rendering = Renderer(renderer.tokenizer, chat_template=TOOL_TEMPLATE)
    assert rendering.renders_tools and rendering.renders_tool_calls
    assert "Let me compute.[call calculator]" in rendering.chat_text(messages, None, None)
    # A template that lists the tools but not an assistant's calls: the probe read the tool's name as the call's
    tools_only = Renderer(renderer.tokenizer, chat_template=TOOL_TEMPLATE.replace("{{ '[call ' + c['function']['name'] + ']' }}", ""))
    assert tools_only.renders_tools and not tools_only.renders_tool_calls
    assert parse_hermes(tools_only.chat_text(messages, None, None)).tool_calls  # written as text


def test_messages_with_the_same_content_and_calls_each_render_as_the_text_they_were_sampled_as(renderer):
    """The server's call ids are unique: two returned messages with the same content and calls, sampled with other
    whitespace, keep their own raw text (keyed without the ids, the second overwrote the first); a message whose ids
    the client rewrote still finds a raw text by its content and calls."""
    continuations = Continuations()

    def returned(call_id: str) -> dict:
        call = {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "3*4"}'}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    first, second = returned("call_1"), returned("call_2")
    raw_first = '<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>'
    raw_second = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
    continuations.remember_message(message_keys(None, first["tool_calls"]), raw_first)
    continuations.remember_message(message_keys(None, second["tool_calls"]), raw_second)
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "12"}
    text = renderer.chat_text([{"role": "user", "content": "3*4?"}, first, tool, second, tool], None, continuations)
    assert raw_first in text and raw_second in text and text.index(raw_first) < text.index(raw_second)
    assert continuations.raw_text(message_keys(None, returned("renamed")["tool_calls"])) == raw_second
    assert len(set(message_keys(None, first["tool_calls"]) + message_keys(None, second["tool_calls"]))) == 3


class Scripted:
    """An engine that answers each prompt with the next of ``texts``, encoded by the tokenizer, then end of turn: what
    the model samples is fixed, so a test can make it sample the same call twice with other whitespace."""

    PER_PROMPT_SEEDS = True

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed) -> list[GeneratedSample]:
        samples = []
        for prompt in prompts:
            ids = self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            cut = len(ids) > params.max_new_tokens  # the token limit ends the turn
            ids = ids[: params.max_new_tokens]
            samples.append(GeneratedSample(list(prompt), ids, [-0.5] * len(ids), cut, 0, 0))
        return samples


TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


@pytest.fixture
def scripted_service() -> Iterator:
    """``serve(texts) -> (service, store)``: the real service, queue, sessions and shipped tokenizer over a
    :class:`Scripted` engine."""
    queues: list[GenerationQueue] = []

    def serve(texts: list[str]) -> tuple[CompletionService, SessionStore]:
        tokenizer = load_tokenizer("embedded:tiny-tool-qwen2")
        queues.append(GenerationQueue(Scripted(tokenizer, texts), window_s=0.0))
        store = SessionStore(vocab_size=len(tokenizer))
        limits = Limits("policy", max_context=512)
        service = CompletionService(Renderer(tokenizer), queues[-1], store, limits, [tokenizer.eos_token_id], parse_hermes)
        return service, store

    yield serve
    for queue in queues:
        queue.close()


def served_chat(service: CompletionService, session_id: str | None, **fields) -> dict:
    """One chat call through the service; the OpenAI answer with ``prompt_token_ids``."""
    request = ChatCompletionRequest(model="policy", tools=TOOLS, return_token_ids=True, **fields)
    return chat_response(asyncio.run(service.chat(request, session_id)), request, "chatcmpl-test")


def test_a_session_that_makes_the_same_call_twice_with_other_whitespace_stays_one_row(scripted_service):
    call = '{"name": "calculator", "arguments": {"expression": "3*4"}}'
    service, store = scripted_service([f"<tool_call>{call}</tool_call>", f"<tool_call>\n{call}\n</tool_call>", "12"])
    messages: list[dict] = [{"role": "user", "content": "3*4?"}]
    for _ in range(2):
        message = served_chat(service, "s", messages=messages)["choices"][0]["message"]
        messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "12"}]
    assert messages[1] == {**messages[3], "tool_calls": messages[1]["tool_calls"]}  # equal but for the call ids
    last = served_chat(service, "s", messages=messages)
    prompt = service.renderer.decode(last["prompt_token_ids"])
    assert f"<tool_call>{call}</tool_call>" in prompt and f"<tool_call>\n{call}\n</tool_call>" in prompt
    (row,) = store.end("s", 1.0).rows  # each call extends the last: one row
    assert row.calls == [(0, 0), (1, 0), (2, 0)]


def test_a_turn_the_token_limit_cut_says_length_even_when_its_call_parses(scripted_service):
    """A call whose JSON was complete when max_tokens cut the turn before its closing tag: the calls are returned (as
    for a stop string's cut) but finish_reason stays "length" (it was "tool_calls": the agent never learnt of the cut)."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}'
    service, _ = scripted_service([call + "</tool_call>", call + "</tool_call>"])
    budget = len(service.renderer.tokenize(call))  # the ids of the call up to its closing tag
    cut = served_chat(service, None, messages=[{"role": "user", "content": "3*4?"}], max_tokens=budget)["choices"][0]
    assert cut["finish_reason"] == "length" and [c["function"]["name"] for c in cut["message"]["tool_calls"]] == ["calculator"]
    whole = served_chat(service, None, messages=[{"role": "user", "content": "3*4?"}])["choices"][0]
    assert whole["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_returns_the_first_call_and_the_history_holds_only_it(scripted_service):
    """As vLLM: only the first call is returned. The message sent back renders as the client holds it (the second
    call's markup, sampled and recorded, is not put back into the history), so the session branches."""
    first, second = (f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}</tool_call>' for e in ("3*4", "5*6"))
    service, store = scripted_service([first + second, first + second, "12"])
    question = [{"role": "user", "content": "3*4 and 5*6?"}]
    both = served_chat(service, None, messages=question)["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in both] == [{"expression": "3*4"}, {"expression": "5*6"}]
    answer = served_chat(service, "s", messages=question, parallel_tool_calls=False)["choices"][0]
    (call,) = answer["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"expression": "3*4"} and answer["finish_reason"] == "tool_calls"
    history = [*question, answer["message"], {"role": "tool", "tool_call_id": call["id"], "content": "12"}]
    prompt = service.renderer.decode(served_chat(service, "s", messages=history)["prompt_token_ids"])
    assert "5*6" not in prompt.split("3*4 and 5*6?")[1]
    result = store.end("s", 1.0)
    assert result.rejected is None and len(result.rows) == 2  # both calls' sampled ids masked in once each


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}], "messages[0].tool_calls"),
        # arguments that are JSON but no object: the template showed the model "arguments": [1, 2] (or null, or 7)
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}],
            "messages[0].tool_calls",
        ),
        ([{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": 7}}]}], "messages[0].tool_calls"),
        ([{"role": "user", "content": "x", "name": 7}], "messages[0].name"),
    ],
)
def test_malformed_messages_are_400_naming_the_message(renderer, messages, param):
    with pytest.raises(ServingError) as error:
        renderer.chat_text(messages, None, None)
    assert error.value.status == 400 and error.value.param == param


def test_a_messages_name_reaches_the_template_whatever_its_role():
    """``name`` was kept for tool messages only: a template that renders it (multi-party prompts) never saw who said
    what, and the request was accepted without a word."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m.get('name') %} name={{ m['name'] }}{% endif %}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    named = Renderer(load_tokenizer("embedded:tiny-tool-qwen2"), chat_template=template)
    messages = [
        {"role": "system", "name": "rules", "content": "be brief"},
        {"role": "user", "name": "alice", "content": "hi"},
        {"role": "assistant", "name": "bot", "content": "hello"},
        {"role": "user", "content": "and bob?"},
    ]
    text = named.chat_text(messages, None, None)
    assert text.count(" name=") == 3 and all(f" name={n}" in text for n in ("rules", "alice", "bot")), text


def test_a_prompt_longer_than_the_context_can_spell_is_refused_before_it_is_tokenised(scripted_service):
    """A 4 MB prompt took the server's tokeniser ~7 s to find too long. A text longer than max_context times the
    longest token's spelling holds more tokens than the context, whatever they are: refused without tokenising."""
    service, _ = scripted_service(["ok"] * 3)
    bound = service.limits.max_context * service.renderer.max_token_chars
    spellings = [len(service.renderer.decode([i])) for i in range(len(service.renderer.tokenizer))]
    assert max(spellings) < service.renderer.max_token_chars  # a bound on every token's decoded text
    tokenised: list[int] = []
    tokenize = service.renderer.tokenize
    service.renderer.tokenize = lambda text: tokenised.append(len(text)) or tokenize(text)
    for body, param in [({"messages": [{"role": "user", "content": "x" * bound}]}, "messages"), ({"prompt": "x" * (bound + 1)}, "prompt")]:
        request = (ChatCompletionRequest if param == "messages" else CompletionRequest)(model="policy", **body)
        with pytest.raises(ServingError) as error:
            asyncio.run(service.chat(request, None) if param == "messages" else service.complete(request, None))
        assert (error.value.code, error.value.param) == ("context_length_exceeded", param)
        assert "more than 512 tokens can spell" in error.value.message
    assert tokenised == []
    served_chat(service, None, messages=[{"role": "user", "content": "x" * 100}])  # an ordinary prompt is tokenised
    assert tokenised


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


@pytest.mark.parametrize(
    "fields", [{"max_tokens": True}, {"n": True}, {"temperature": True}, {"seed": "7"}, {"logprobs": "yes"}, {"max_tokens": "3"}]
)
def test_request_fields_of_the_wrong_json_type_are_refused_not_converted(fields):
    """Lax parsing had read ``max_tokens: true`` as 1 (one-token answers), ``seed: "7"`` as 7; OpenAI answers 400."""
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], **fields)
    ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], temperature=1, n=None)  # an int is a float
    with pytest.raises(ValidationError):
        EndSessionRequest(reward=True)
    with pytest.raises(ValidationError):
        OpenSessionRequest(session_id=7)


def test_contradictory_or_unimplemented_limits_and_tool_settings_are_refused():
    def checked(**fields) -> None:
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], **fields).check_supported()

    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for fields, param in [
        ({"max_tokens": 3, "max_completion_tokens": 20}, "max_tokens"),  # max_tokens had been dropped silently
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ]:
        with pytest.raises(ServingError) as error:
            checked(**fields)
        assert (error.value.status, error.value.param) == (400, param), fields
    checked(max_tokens=5, max_completion_tokens=5)
    checked(tool_choice="none")
    checked(tools=tools, tool_choice="auto", parallel_tool_calls=False)
    # strict: arguments would have to follow the schema, which nothing enforces (it was accepted and ignored)
    with pytest.raises(ServingError) as error:
        checked(tools=[{"type": "function", "function": {"name": "f", "parameters": {}, "strict": True}}])
    assert (error.value.param, error.value.code) == ("tools[0].function.strict", "unsupported_parameter")
    checked(tools=[{"type": "function", "function": {"name": "f", "parameters": {}, "strict": False}}])
    with pytest.raises(ServingError) as error:  # FastAPI's reader takes NaN and 1e400: the schema reached the prompt so
        checked(tools=[{"type": "function", "function": {"name": "f", "parameters": {"maximum": float("inf")}}}])
    assert (error.value.status, error.value.param) == (400, "tools[0]")
    with pytest.raises(ServingError) as error:  # a string is not a boolean (it read as true: 'unsupported')
        checked(tools=[{"type": "function", "function": {"name": "f", "parameters": {}, "strict": "false"}}])
    assert (error.value.status, error.value.param) == (400, "tools[0].function.strict") and error.value.code != "unsupported_parameter"
    # Completions' logprobs=1 asks for the top alternative at each position, which is not returned (it had answered None).
    with pytest.raises(ServingError) as error:
        CompletionRequest(model="m", prompt=[1, 2], logprobs=1).check_supported()
    assert (error.value.param, error.value.code) == ("logprobs", "unsupported_parameter")
    CompletionRequest(model="m", prompt=[1, 2], logprobs=0).check_supported()


SENTENCEPIECE = Path(__file__).parents[2] / "fixtures" / "tiny_sentencepiece"
CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def shipped_and_sentencepiece() -> list:
    sp = LlamaTokenizer.from_pretrained(SENTENCEPIECE, add_bos_token=False, legacy=False, pad_token="<pad>")
    return [load_tokenizer("embedded:tiny-tool-qwen2"), sp]


def random_texts(tokenizer, count: int, seed: int) -> list[str]:
    """Text the probes do not hold: runs of letters, digits, spaces, new lines, non-ASCII, markup and special tokens."""
    rng = random.Random(seed)
    pieces = ["a", "Zq", "  ", " ", "\n", "\t", "42", "é", "中", "🙂", "<", "/>", "{", '"', "’", *tokenizer.all_special_tokens]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(count)]


@pytest.mark.parametrize("index", [0, 1], ids=["byte-level-bpe", "sentencepiece"])
def test_the_renderer_encodes_and_decodes_on_the_rust_backend_as_the_wrapper_does(index):
    tokenizer = shipped_and_sentencepiece()[index]
    renderer = Renderer(tokenizer, CHATML)
    assert renderer._direct is not None  # both fast tokenizers pass the probes: the direct path is what is tested here
    for text in random_texts(tokenizer, 300, seed=index):
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert renderer.tokenize(text) == ids, text
        assert renderer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert renderer.tokenize_continuation(text) == Renderer(tokenizer, CHATML).tokenize_continuation(text)
    # Truncation left on the shared backend by another caller: the wrapper resets it for its call, so must we.
    tokenizer.backend_tokenizer.enable_truncation(max_length=2)
    try:
        long_text = "a b c d e f g h"
        assert renderer.tokenize(long_text) == list(tokenizer(long_text, add_special_tokens=False)["input_ids"])
        assert len(renderer.tokenize(long_text)) > 2
    finally:
        tokenizer.backend_tokenizer.no_truncation()
    # Padding to a multiple left on it the same way (a wrapper call with pad_to_multiple_of sets it until its next call).
    tokenizer(["a", "a b c"], padding=True, pad_to_multiple_of=8)
    assert tokenizer.backend_tokenizer.padding["pad_to_multiple_of"] == 8
    assert renderer.tokenize("a b c") == list(tokenizer("a b c", add_special_tokens=False)["input_ids"])


def legacy_sentencepiece(prepend_normalizer: bool):
    """The fixture with ``legacy=True`` (Metaspace ``prepend_scheme: "always"``), or rebuilt as Llama-2's
    ``tokenizer.json`` is (a ``Prepend("▁")`` normalizer, no pre-tokenizer): both put a ``▁`` in front of every text
    between special tokens."""
    sp = LlamaTokenizer.from_pretrained(SENTENCEPIECE, add_bos_token=False, legacy=True, pad_token="<pad>")
    if not prepend_normalizer:
        return sp
    spec = json.loads(sp.backend_tokenizer.to_str())
    to_marker = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    spec.update(pre_tokenizer=None, normalizer={"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, to_marker]})
    backend = type(sp.backend_tokenizer).from_str(json.dumps(spec))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    return PreTrainedTokenizerFast(tokenizer_object=backend, additional_special_tokens=["<|im_start|>", "<|im_end|>"], **specials)


@pytest.mark.parametrize("prepend_normalizer", [False, True], ids=["metaspace-always", "prepend-normalizer"])
def test_a_legacy_sentencepiece_tokenizer_encodes_a_continuation_without_a_space_it_does_not_have(prepend_normalizer):
    legacy = legacy_sentencepiece(prepend_normalizer)
    renderer, current = Renderer(legacy, CHATML), Renderer(shipped_and_sentencepiece()[1], CHATML)
    behind_anchor = legacy.convert_ids_to_tokens(legacy("<s>.a", add_special_tokens=False)["input_ids"])
    assert behind_anchor[:2] == ["<s>", "\u2581"]  # the space the server must not encode
    for text in [". Let me check.", "a b", " a", *random_texts(legacy, 200, seed=2)]:
        ids = renderer.tokenize_continuation(text)
        assert renderer.decode_continuation(ids) == text, text
        assert ids == current.tokenize_continuation(text), text  # what the non-legacy tokenizer encodes
    assert renderer.tokenize("a b") == legacy("a b", add_special_tokens=False)["input_ids"]  # whole prompts: unchanged
    assert Renderer(load_tokenizer("embedded:tiny-tool-qwen2"))._rest_backend is None  # byte-level BPE needs nothing


@pytest.mark.parametrize("add_bos", [True, False])
def test_a_completions_text_prompt_starts_with_the_bos_its_tokenizer_adds_once(add_bos):
    """vLLM's completions endpoint tokenises a text prompt with the tokenizer's special tokens (its BOS); ours never
    added one, so a BOS-trained base model (Llama, Mistral) was prompted without it."""
    sp = LlamaTokenizer.from_pretrained(SENTENCEPIECE, add_bos_token=add_bos, legacy=False, pad_token="<pad>")
    renderer = Renderer(sp, chat_template=CHATML)
    expected = sp("hello world", add_special_tokens=True)["input_ids"]
    assert renderer.text_prompt_ids("hello world") == expected and (expected[0] == sp.bos_token_id) == add_bos
    assert renderer.text_prompt_ids("<s>hello").count(sp.bos_token_id) == 1  # spelled by the text: not twice
    queue = GenerationQueue(Scripted(sp, ["one", "two", "three"]), window_s=0.0)
    try:  # through the service: a call alone, and a session's second call that extends its first (its ids reused)
        store = SessionStore(vocab_size=len(sp))
        service = CompletionService(renderer, queue, store, Limits("policy", max_context=128), [sp.eos_token_id], parse_hermes)
        alone = asyncio.run(service.complete(CompletionRequest(model="policy", prompt="hello world", max_tokens=4), None))
        assert alone.prompt_ids == expected
        sid = store.open()
        first = asyncio.run(service.complete(CompletionRequest(model="policy", prompt="hello", max_tokens=4), sid))
        second = asyncio.run(service.complete(CompletionRequest(model="policy", prompt="hello" + "one" + " more", max_tokens=4), sid))
        assert first.prompt_ids[: len(renderer.text_prompt_prefix)] == renderer.text_prompt_prefix
        assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids and second.prompt_ids.count(sp.bos_token_id) == add_bos
    finally:
        queue.close()


def test_a_legacy_tokenizer_the_server_cannot_correct_is_logged(caplog):
    class Wrapped(LlamaTokenizer):  # not fast: no Rust backend of its own to copy
        is_fast = False

    legacy = legacy_sentencepiece(prepend_normalizer=False)
    legacy.__class__ = Wrapped
    with caplog.at_level("WARNING", logger="nemo_like.serving"):
        renderer = Renderer(legacy, CHATML)
    assert renderer._rest_backend is None and "word-start space" in caplog.text


def test_the_direct_path_adds_no_bos_where_the_tokenizer_would():
    with_bos = LlamaTokenizer.from_pretrained(SENTENCEPIECE, add_bos_token=True, legacy=False, pad_token="<pad>")
    renderer = Renderer(with_bos, CHATML)
    assert renderer._direct is not None and with_bos("hi")["input_ids"][0] == with_bos.bos_token_id
    assert renderer.tokenize("hi") == list(with_bos("hi", add_special_tokens=False)["input_ids"])
    assert with_bos.bos_token_id not in renderer.tokenize("hi")


def test_a_wrapper_that_processes_text_itself_keeps_the_wrapper():
    tokenizer = load_tokenizer("embedded:tiny-tool-qwen2")
    assert direct_backend(tokenizer) is tokenizer.backend_tokenizer

    class Lowercasing(type(tokenizer)):
        def __call__(self, text, **kwargs):
            return super().__call__(text.lower(), **kwargs)

    tokenizer.__class__ = Lowercasing
    assert direct_backend(tokenizer) is None
    renderer = Renderer(tokenizer)
    assert renderer.tokenize("Hello World") == list(tokenizer("Hello World", add_special_tokens=False)["input_ids"])


def test_the_longest_remembered_prefix_is_reused_whatever_the_order_it_was_remembered_in():
    continuations = Continuations()

    def tokenize(text: str) -> list[int]:
        return [ord(c) for c in text]

    continuations.add("ab", [1])
    continuations.add("abcd", [2])
    continuations.add("abc", [3])
    continuations.add("ab", [4])  # the same text again: the first one remembered stays the one reused
    continuations.add("abcdefgh", [5])  # longer than the prompts below: never a prefix of them
    assert continuations.prompt_ids("abcdX", tokenize) == [2, ord("X")]
    assert continuations.prompt_ids("abcX", tokenize) == [3, ord("X")]
    assert continuations.prompt_ids("abX", tokenize) == [1, ord("X")]
    assert continuations.prompt_ids("abcd", tokenize) == [2]
    assert continuations.prompt_ids("xyz", tokenize) == tokenize("xyz")


def test_a_sessions_history_is_normalised_once_unless_a_message_or_its_raw_text_changes():
    continuations = Continuations()
    normalised: list[int] = []

    def normalize(message, index, context):
        normalised.append(index)
        key = message["content"] if message["role"] == "assistant" else None
        lookup = RawLookup((key,), continuations.raw_text([key])) if key is not None else None
        return {**message, "raw": lookup.raw_text if lookup else None}, lookup

    user, answer, tool = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"}, {"role": "tool", "content": "7"}
    history = [user, answer, tool]
    assert continuations.normalized([user], normalize) == [{**user, "raw": None}] and normalised == [0]
    assert [m["raw"] for m in continuations.normalized(history, normalize)] == [None, None, None] and normalised == [0, 1, 2]
    again = [dict(m) for m in history] + [{"role": "assistant", "content": "a2"}]  # equal copies, as a new request parses them
    continuations.normalized(again, normalize)
    assert normalised == [0, 1, 2, 3]
    continuations.remember_message(["a1"], "<raw a1>")  # the lookup message 1 depended on answers differently now
    forms = continuations.normalized(again, normalize)
    assert normalised == [0, 1, 2, 3, 1] and forms[1]["raw"] == "<raw a1>"
    edited = [user, answer, {"role": "tool", "content": "8"}, again[3]]  # a client that rewrote one message
    # the rewritten message, and the assistant message after it, whose raw text is looked up after its history
    assert continuations.normalized(edited, normalize)[2]["content"] == "8" and normalised == [0, 1, 2, 3, 1, 2, 3]
    shorter = [user, {"role": "user", "content": "other"}]  # not an extension: equal messages by index are reused
    assert continuations.normalized(shorter, normalize)[1]["content"] == "other" and normalised == [0, 1, 2, 3, 1, 2, 3, 1]


def test_two_turns_returning_the_same_content_each_render_as_their_own_sampled_text(renderer):
    """A stop string cut turn 1's sampled '47' and turn 2's '40' to the same content '4': the session kept one raw text
    per content, so turn 3 rendered turn 1 as '40' (a history the model never produced) and the session split."""
    continuations = Continuations()
    first = [{"role": "user", "content": "q"}]
    renderer.chat_text(first, None, continuations)  # each call is rendered, then its answer remembered
    continuations.remember_message(message_keys("4", None), "47", continuations.history_digests(first)[-1])
    second = [*first, {"role": "assistant", "content": "4"}, {"role": "user", "content": "again?"}]
    renderer.chat_text(second, None, continuations)
    continuations.remember_message(message_keys("4", None), "40", continuations.history_digests(second)[-1])
    third = [*second, {"role": "assistant", "content": "4"}, {"role": "user", "content": "final?"}]

    def as_sampled(messages, *raw):
        answers = iter(raw)
        return [{**m, "content": next(answers)} if m["role"] == "assistant" else m for m in messages]

    assert renderer.chat_text(third, None, continuations) == renderer.chat_text(as_sampled(third, "47", "40"), None, None)
    # a client that edited the history before them: both fall back to the last returned message with that content
    edited = [{"role": "user", "content": "q, edited"}, *third[1:]]
    assert renderer.chat_text(edited, None, continuations) == renderer.chat_text(as_sampled(edited, "40", "40"), None, None)


def test_a_renderings_text_does_not_depend_on_what_earlier_calls_normalised(renderer):
    continuations = Continuations()
    messages: list[dict] = [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 2*3?"}]
    for turn in range(6):
        calls = [{"id": f"call_{turn}", "type": "function", "function": {"name": "calc", "arguments": '{"e": "2*3"}'}}]
        messages = messages + [{"role": "assistant", "content": f"turn {turn}", "tool_calls": calls}, {"role": "tool", "content": "6"}]
        if turn % 2 == 0:  # some answers were the server's (rendered as their raw text), some the client's own
            continuations.remember_message(message_keys(f"turn {turn}", calls), f"<raw {turn}>")
        if turn == 3:
            continuations.remember_message(message_keys("turn 0", messages[2]["tool_calls"]), "<raw 0, again>")
        fresh = Continuations()
        fresh._raw = dict(continuations._raw)
        assert renderer.chat_text(messages, None, continuations) == renderer.chat_text(messages, None, fresh)
    assert "<raw 0, again>" in renderer.chat_text(messages, None, continuations)


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")


def test_a_call_cut_inside_a_longer_draw_reports_its_kept_tokens_weight_version() -> None:
    """A call cut to its own max_tokens or at a stop string inside a draw an in-flight refit changed reported the
    draw's last version (a session across refits that was not); the HF engine says where each swap began."""
    from nemo_like.models.generation.interface import GeneratedSample
    from nemo_like.serving.batching import cut_to

    hf = GeneratedSample([1], [5, 6, 7, 8, 9], [-1.0] * 5, False, 0, final_weight_version=1, weight_version_changes=((3, 1),))
    assert [hf.kept_version(k) for k in (1, 3, 4, 5)] == [0, 0, 1, 1]
    assert cut_to(hf, 3).final_weight_version == 0 and cut_to(hf, 4).final_weight_version == 1
    vllm = GeneratedSample([1], [5, 6, 7, 8, 9], [-1.0] * 5, False, 0, final_weight_version=1)  # one version per draw
    assert vllm.kept_version(2) == 1 and cut_to(vllm, 2).final_weight_version == 1  # an upper bound
    assert GeneratedSample([1], [5], [-1.0], False, 4).kept_version(1) is None  # the engine said nothing
    # the tokens past the cut were decoded all the same (performance/num_generated_tokens), once even if cut twice
    assert cut_to(hf, 3).num_decoded_tokens == 5 == cut_to(cut_to(hf, 4), 3).num_decoded_tokens and cut_to(hf, 5) is hf


def test_completion_logprobs_offsets_index_the_text_and_partial_characters_are_named_by_bytes(renderer):
    """Each token was decoded alone and the offsets summed those strings' lengths: a byte-level token holding part of a
    Chinese character counted as one U+FFFD character, so the offsets ran past the text (18 in an 8-character text)."""
    from nemo_like.serving.responses import completion_response
    from nemo_like.serving.service import SampledCall, SampledChoice

    text = "价格是 5 元。"
    ids = renderer.tokenize(text) + renderer.tokenize(" STOP here")  # tokens past a stop string's cut, as a stop leaves
    call = SampledCall([1, 2], [SampledChoice(0, ids, [-0.5] * len(ids), text, "stop", 0)])
    request = CompletionRequest(model="policy", prompt="Q:", logprobs=0)
    body = completion_response(call, request, "cmpl-1", lambda t: renderer.decode_continuation([t]), renderer.token_bytes)
    logprobs = body["choices"][0]["logprobs"]
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert len(tokens) == len(offsets) == len(ids) and offsets == sorted(offsets) and max(offsets) == len(text)
    partial = [t for t in tokens if t.startswith("bytes:")]
    assert partial and not any("\ufffd" in t for t in tokens)  # a part of a character: its bytes, not U+FFFD
    spelled = b"".join(bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode() for t in tokens)
    assert spelled.decode().startswith(text)  # the tokens spell the text
    for token, offset in zip(tokens, offsets):
        if not token.startswith("bytes:") and offset < len(text):
            assert text[offset:].startswith(token) or not text[offset:]  # a whole token starts where its offset says
    assert offsets[tokens.index("5")] == text.index("5")


def test_a_stray_continuation_byte_is_a_character_of_its_own_in_the_completion_offsets(renderer):
    """A token whose first byte continues no open character (a sampled byte after a complete character) decodes to a
    U+FFFD of its own: counted as part of the character before it, it and every later token's offset pointed one
    character early."""
    from nemo_like.serving.responses import completion_response
    from nemo_like.serving.service import SampledCall, SampledChoice

    stray = next(t for t in range(renderer.tokenizer.vocab_size) if renderer.token_bytes(t) == b"\x81")
    head, tail = renderer.tokenize("96"), renderer.tokenize("x")
    ids = [*head, stray, *tail]
    text = b"".join(renderer.token_bytes(t) for t in ids).decode("utf-8", "replace")
    assert text == "96\ufffdx"
    call = SampledCall([1, 2], [SampledChoice(0, ids, [-0.5] * len(ids), text, "length", 0)])
    body = completion_response(call, CompletionRequest(model="policy", prompt="Q:", logprobs=0), "cmpl-1",
                               lambda t: renderer.decode_continuation([t]), renderer.token_bytes)  # fmt: skip
    offsets = body["choices"][0]["logprobs"]["text_offset"]
    assert offsets[len(head)] == 2 and offsets[-1] == 3, offsets
    # and a continuation byte that continues an open character stays on it: "价" split over two tokens
    lead, rest = b"\xe4\xbb", b"\xb7"
    first = next(t for t in range(renderer.tokenizer.vocab_size) if renderer.token_bytes(t) == lead[:1])
    seconds = [next(t for t in range(renderer.tokenizer.vocab_size) if renderer.token_bytes(t) == bytes([b])) for b in lead[1:] + rest]
    ids = [first, *seconds, *tail]
    call = SampledCall([1, 2], [SampledChoice(0, ids, [-0.5] * len(ids), "价x", "length", 0)])
    body = completion_response(call, CompletionRequest(model="policy", prompt="Q:", logprobs=0), "cmpl-1",
                               lambda t: renderer.decode_continuation([t]), renderer.token_bytes)  # fmt: skip
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 0, 0, 1]
