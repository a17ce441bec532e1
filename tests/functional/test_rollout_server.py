"""The rollout server end to end: the real ``openai`` client over HTTP, a real uvicorn server in this process, the
shipped tiny tool model sampled by the in-process engine. Token exactness of the rows, branching under a template
that rewrites history, the API key and loopback binding, concurrent sessions, and the bad-input answers."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import httpx
import openai
import pytest
import torch

from nemo_like.data.collate import collate_samples
from nemo_like.environments.tools.calculator import calculator
from nemo_like.environments.tools.errors import ToolError
from nemo_like.models.generation.interface import SamplingParams
from nemo_like.models.loading import load_tokenizer
from nemo_like.serving import RolloutServer, ServerConfig
from nemo_like.serving.local_engine import LocalGeneration
from nemo_like.serving.trajectory import CallRecord, unsampled_positions

pytestmark = pytest.mark.slow
MODEL = "embedded:tiny-tool-qwen2"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
THINK_TEMPLATE = FIXTURES / "qwen3_style_think.jinja"
SYSTEM_TEMPLATE = FIXTURES / "system_before_last_user.jinja"  # rewrites where the system message goes
SENTENCEPIECE = FIXTURES / "tiny_sentencepiece"  # scripts/build_sentencepiece_fixture.py
CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
TOOLS = [
    {
        "type": "function",
        "function": {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}},
    }
]
PROBLEMS = [f"What is {100 + 7 * i} times {11 + i}?" for i in range(64)]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def engine(tokenizer):
    torch.set_num_threads(1)
    # With the tokenizer, as `nemo-like serve` builds it: a row stops sampling at a request's stop strings
    return LocalGeneration.load(MODEL, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer=tokenizer)


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with RolloutServer(engine, tokenizer, ServerConfig(max_n=4)) as srv:
        yield srv


def client(srv: RolloutServer, session_id: str | None = None) -> openai.OpenAI:
    headers = {"X-Session-Id": session_id} if session_id else None
    return openai.OpenAI(base_url=srv.base_url, api_key=srv.api_key, default_headers=headers, max_retries=0)


def chat(c: openai.OpenAI, messages: list, **kwargs):
    extra = {"return_token_ids": True, **kwargs.pop("extra_body", {})}
    return c.chat.completions.create(model="policy", messages=messages, tools=TOOLS, extra_body=extra, **kwargs)


def tool_turn(messages: list, response) -> None:
    """Append the assistant message as the client returned it, then the calculator's answer, its error (the sampled
    expression may not parse; an error is an observation too) or a nudge."""
    message = response.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if message.tool_calls:
        expression = json.loads(message.tool_calls[0].function.arguments).get("expression", "")
        try:
            answer = calculator(expression=str(expression))
        except ToolError as exc:
            answer = f"error: {exc}"
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": answer})
    else:
        messages.append({"role": "tool", "content": "no tool was called"})


def model_logprobs(engine: LocalGeneration, rows: list, pad_token_id: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """What the training pass computes: log p(token_t | tokens_<t) at ``temperature`` for every row ([B, S], masked),
    and the batch's generation logprobs (masked)."""
    batch = collate_samples([r.to_generated_sample() for r in rows], pad_token_id)
    with torch.no_grad():
        logits = engine.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    trained = torch.nn.functional.pad(logprobs, (1, 0)) * batch["token_mask"]
    return trained, batch["generation_logprobs"] * batch["token_mask"]


def first_call_that_does_not_round_trip(server: RolloutServer, tokenizer, messages: list):
    """A first call whose sampled ids are not what its text re-encodes to (byte-level BPE is not a bijection; at
    temperature 2 the tiny model soon samples such ids): ``(session_id, response)``."""
    for seed in range(40):
        session_id = f"exact-{seed}"
        response = chat(client(server, session_id), messages, temperature=2.0, seed=seed, max_tokens=24)
        ids = response.choices[0].completion_token_ids
        if tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] != ids:
            return session_id, response
        server.sessions.end(session_id)
    pytest.fail("no sampled completion in 40 seeds re-encodes differently")


def test_a_tool_session_is_one_row_of_exactly_the_sampled_ids(server, engine, tokenizer):
    messages = [{"role": "user", "content": PROBLEMS[0]}]
    session_id, first = first_call_that_does_not_round_trip(server, tokenizer, messages)
    tool_turn(messages, first)
    second = chat(client(server, session_id), messages, temperature=2.0, seed=1, max_tokens=24)
    rendered = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    assert first.prompt_token_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]

    (row,) = server.sessions.end(session_id, reward=1.0).rows
    completions = [r.choices[0].completion_token_ids for r in (first, second)]
    assert row.prompt_ids == first.prompt_token_ids
    assert row.input_ids[: len(second.prompt_token_ids)] == second.prompt_token_ids  # call 2 extends call 1 exactly
    observation = len(second.prompt_token_ids) - len(row.prompt_ids) - len(completions[0])
    assert row.response_ids == completions[0] + second.prompt_token_ids[-observation:] + completions[1]
    assert row.response_mask == [1] * len(completions[0]) + [0] * observation + [1] * len(completions[1])
    recorded = first.choices[0].completion_logprobs + second.choices[0].completion_logprobs
    assert [lp for lp, m in zip(row.response_logprobs, row.response_mask) if m] == recorded
    trained, generated = model_logprobs(engine, [row], tokenizer.pad_token_id, temperature=2.0)
    assert torch.allclose(trained, generated, atol=1e-5)  # the training pass agrees with the server's logprobs

    greedy = chat(client(server), [{"role": "user", "content": PROBLEMS[1]}], temperature=0)
    (direct,) = engine.generate([greedy.prompt_token_ids], SamplingParams(max_new_tokens=256, greedy=True), seed=0)
    assert greedy.choices[0].completion_token_ids == direct.response_ids  # the engine's own ids, not re-tokenised text


def test_an_agent_that_stops_at_the_closing_tag_gets_its_tool_call_and_stays_one_row(server, tokenizer):
    """``stop=["</tool_call>"]`` (common in agents) cuts the text before the closing tag: the call is still returned,
    as vLLM does, the recorded ids keep the tag, and the message sent back renders as them (one row)."""
    c, messages = client(server, "stop-at-tag"), [{"role": "user", "content": "What is 121 times 13?"}]
    first = chat(c, messages, temperature=0, max_tokens=40, stop=["</tool_call>"])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == [
        ("calculator", {"expression": "121*13"})
    ]
    assert tokenizer.decode(choice.completion_token_ids).endswith("</tool_call>")  # the sampled ids, unchanged
    tool_turn(messages, first)
    second = chat(c, messages, temperature=0, max_tokens=8)
    (row,) = server.sessions.end("stop-at-tag", reward=1.0).rows
    assert second.prompt_token_ids[: len(row.prompt_ids) + len(choice.completion_token_ids)] == (
        first.prompt_token_ids + choice.completion_token_ids
    )


def test_a_tool_parser_that_raises_returns_the_text_as_content_not_a_500_after_recording(server, monkeypatch, caplog):
    """A parser's error (a plug-in's bug; the built-in one's json.dumps of an argument past a float's range) came after
    the call was recorded: a 500, which the openai client retries, and each retry sampled and recorded one more call."""

    def broken(text: str):
        raise ValueError("a plug-in's bug")

    monkeypatch.setattr(server.service, "tool_parser", broken)
    c = client(server, "broken-parser")
    answer = chat(c, [{"role": "user", "content": "What is 121 times 13?"}], temperature=0, max_tokens=40)
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and "<tool_call>" in choice.message.content  # the markup, as content
    assert len(server.sessions.end("broken-parser", reward=0.0).rows) == 1
    assert "the tool parser raised" in caplog.text


def test_a_template_that_strips_reasoning_branches_the_session(engine, tokenizer):
    config = ServerConfig(chat_template=THINK_TEMPLATE.read_text())
    with RolloutServer(engine, tokenizer, config) as srv:
        c = client(srv, "think")
        messages = [{"role": "user", "content": PROBLEMS[2]}]
        responses = [chat(c, messages, temperature=1.0, max_tokens=24, seed=1)]  # seeded: CI draws the same tokens
        tool_turn(messages, responses[-1])
        responses.append(chat(c, messages, temperature=1.0, max_tokens=24, seed=2))
        messages += [responses[-1].choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": PROBLEMS[3]}]
        responses.append(chat(c, messages, temperature=1.0, max_tokens=24, seed=3))  # earlier turns lose their <think> block
        result = srv.sessions.end("think", reward=0.5)
    assert result.rejected is None and [r.calls for r in result.rows] == [[(0, 0), (1, 0)], [(2, 0)]]
    assert srv.sessions.metrics()["agent/branched_sessions"] == 1.0
    sampled = [r.choices[0].completion_token_ids for r in responses]
    assert sum(sum(r.response_mask) for r in result.rows) == sum(len(s) for s in sampled)  # each sampled token once
    calls = [
        CallRecord(tuple(r.prompt_token_ids), tuple(s), tuple(r.choices[0].completion_logprobs), 0, 0, call_index=i)
        for i, (r, s) in enumerate(zip(responses, sampled))
    ]
    for row in result.rows:
        assert unsampled_positions(row.input_ids, [0] * len(row.prompt_ids) + row.response_mask, calls) == []
    trained, generated = model_logprobs(engine, result.rows, tokenizer.pad_token_id)
    assert (trained - generated).abs().max().item() < 1e-5

    # The naive single row: call 3's new tokens cut from its prompt by length, as if it extended the first row.
    naive = list(result.rows[0].input_ids)
    naive_mask = [0] * len(result.rows[0].prompt_ids) + result.rows[0].response_mask
    observation = list(responses[2].prompt_token_ids[len(naive) :])
    naive += observation + sampled[2]
    naive_mask += [0] * len(observation) + [1] * len(sampled[2])
    assert unsampled_positions(naive, naive_mask, calls) != []  # it would train on tokens in contexts never sampled


def test_a_template_that_rewrites_the_system_message_branches_the_session(engine, tokenizer):
    with RolloutServer(engine, tokenizer, ServerConfig(chat_template=SYSTEM_TEMPLATE.read_text())) as srv:
        c = client(srv, "system")
        messages = [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": PROBLEMS[4]}]
        responses = [chat(c, messages, temperature=1.0, max_tokens=16, seed=1)]
        messages += [responses[0].choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": PROBLEMS[5]}]
        responses.append(chat(c, messages, temperature=1.0, max_tokens=16, seed=2))  # the system text moved to the new user turn
        result = srv.sessions.end("system", reward=1.0)
    first_rendering = responses[0].prompt_token_ids + responses[0].choices[0].completion_token_ids
    assert responses[1].prompt_token_ids[: len(first_rendering)] != first_rendering
    assert result.rejected is None and [r.calls for r in result.rows] == [[(0, 0)], [(1, 0)]]
    sampled = [r.choices[0].completion_token_ids for r in responses]
    assert [r.response_ids[: len(s)] for r, s in zip(result.rows, sampled)] == sampled and all(all(r.response_mask) for r in result.rows)
    trained, generated = model_logprobs(engine, result.rows, tokenizer.pad_token_id)
    assert (trained - generated).abs().max().item() < 1e-5


@pytest.mark.parametrize("legacy", [False, True], ids=["sentencepiece", "legacy-sentencepiece"])
def test_a_sentencepiece_session_keeps_the_spaces_the_model_sampled(legacy):
    """SentencePiece marks a word start with ``▁``; a text encoded or decoded on its own gains or loses that space.
    Served: a completion's text is its text after the prompt, and a prompt that reuses a session's ids encodes the
    rest as their continuation, so the ids spell exactly the text the client sent (an extra ``▁`` otherwise). A legacy
    tokenizer adds the ``▁`` even behind a special token: the server encodes the rest without it."""
    from transformers import LlamaTokenizer, Qwen2Config, Qwen2ForCausalLM

    sp = LlamaTokenizer.from_pretrained(SENTENCEPIECE, add_bos_token=False, legacy=legacy, pad_token="<pad>")
    sp.chat_template = CHATML
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(sp), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # a random model that samples word pieces (not bytes or markup): readable text to send back
        model.lm_head.weight.mul_(20)
        for i, piece in enumerate(sp.convert_ids_to_tokens(list(range(len(sp))))):
            if piece.startswith("<") or i < 4:
                model.lm_head.weight[i] = 0
    engine = LocalGeneration(model.eval(), sp.pad_token_id, [sp.eos_token_id])
    with RolloutServer(engine, sp, ServerConfig(max_context=256)) as srv:
        c = client(srv, "sp")
        first_prompt = "What is 12 times 3? The answer is"
        first = c.completions.create(
            model="policy", prompt=first_prompt, max_tokens=8, temperature=1.0, seed=3, extra_body={"return_token_ids": True}
        )
        completion = first.choices[0].model_extra["completion_token_ids"]
        assert sp.convert_ids_to_tokens(completion)[0].startswith("▁")  # the sampled text starts with a space ...
        assert first.choices[0].text == sp.decode(first.prompt_token_ids + completion)[len(first_prompt) :]  # ... returned
        second_prompt = first_prompt + first.choices[0].text + ". Let me check."
        second = c.completions.create(
            model="policy", prompt=second_prompt, max_tokens=8, temperature=1.0, seed=4, extra_body={"return_token_ids": True}
        )
        result = srv.sessions.end("sp", reward=1.0)
    reused = first.prompt_token_ids + completion
    assert second.prompt_token_ids[: len(reused)] == reused and len(result.rows) == 1  # one row: call 2 extends call 1
    assert sp.decode(second.prompt_token_ids) == second_prompt  # the ids spell the prompt the client sent
    naive = reused + sp(". Let me check.", add_special_tokens=False)["input_ids"]  # the rest encoded on its own
    assert sp.decode(naive) != second_prompt  # it would hold a space the client never sent
    trained, generated = model_logprobs(engine, result.rows, sp.pad_token_id)
    assert (trained - generated).abs().max().item() < 1e-5


def test_every_request_needs_the_key_and_the_server_listens_on_loopback_only(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="not-the-key", max_retries=0).models.list()
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": server.api_key}):
        answer = httpx.post(f"{server.base_url}/chat/completions", headers=headers, content=b"{not json")
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        assert server.api_key not in answer.text
    assert client(server).models.list().data[0].id == "policy"
    assert client(server).models.retrieve("policy").id == "policy"  # it was a bare 404: some frameworks check it
    with pytest.raises(openai.NotFoundError, match="this server serves 'policy'"):
        client(server).models.retrieve("gpt-4o")
    assert server.base_url.startswith("http://127.0.0.1:")
    with pytest.raises(ValueError, match="not a loopback address"):
        RolloutServer(server.queue.engine, server.service.renderer.tokenizer, ServerConfig(host="0.0.0.0"))
    address = _non_loopback_address()
    if address is not None:  # the same port on this machine's other address refuses the connection
        with pytest.raises(OSError):
            socket.create_connection((address, server.port), timeout=2).close()


def _non_loopback_address() -> str | None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_sixty_four_concurrent_sessions_keep_their_own_calls(server):
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def agent(i: int) -> None:
        session_id = f"concurrent-{i}"
        try:  # half name the session in the header, half in the `user` field
            c = client(server, session_id if i % 2 else None)
            extra = {} if i % 2 else {"user": session_id}
            messages = [{"role": "user", "content": PROBLEMS[i]}]
            first = chat(c, messages, temperature=1.0, max_tokens=32, seed=i, **extra)  # per-prompt seeds: same draws in CI
            tool_turn(messages, first)
            results[session_id] = [first, chat(c, messages, temperature=1.0, max_tokens=32, seed=64 + i, **extra)]
        except BaseException as exc:  # reported below with the others
            errors.append(exc)

    before = (server.queue.stats.engine_calls, server.queue.stats.prompts)
    threads = [threading.Thread(target=agent, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == [] and len(results) == 64
    engine_calls, prompts = server.queue.stats.engine_calls - before[0], server.queue.stats.prompts - before[1]
    assert prompts == 128 and engine_calls < prompts  # concurrent calls shared engine batches
    for i in range(64):
        first, second = results[f"concurrent-{i}"]
        assert first.session_id == second.session_id == f"concurrent-{i}"
        (row,) = server.sessions.end(f"concurrent-{i}", reward=float(i)).rows
        assert PROBLEMS[i] in server.service.renderer.decode(row.prompt_ids)
        assert row.prompt_ids == first.prompt_token_ids and row.input_ids[: len(second.prompt_token_ids)] == second.prompt_token_ids
        sampled = first.choices[0].completion_token_ids + second.choices[0].completion_token_ids
        assert [t for t, m in zip(row.response_ids, row.response_mask) if m] == sampled and row.reward == float(i)


def test_completions_endpoint_returns_the_sampled_ids_and_cuts_at_stop_strings(server):
    c = client(server)
    text = c.completions.create(
        model="policy", prompt="What is 12 times 3?", max_tokens=8, logprobs=0, extra_body={"return_token_ids": True}
    )
    choice = text.choices[0]
    assert choice.logprobs.token_logprobs == choice.completion_logprobs and len(choice.completion_token_ids) <= 8
    ids = c.completions.create(
        model="policy", prompt=text.prompt_token_ids, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    assert ids.prompt_token_ids == text.prompt_token_ids
    # A stop string taken from the unstopped greedy text (a "<" the tiny model never wrote let this pass on the eos)
    whole = ids.choices[0]
    assert len(whole.text) >= 2, whole.text
    stop = whole.text[1]
    stopped = c.completions.create(
        model="policy", prompt=text.prompt_token_ids, max_tokens=8, temperature=0, stop=[stop], extra_body={"return_token_ids": True}
    )
    cut = stopped.choices[0]
    assert cut.text == whole.text[: whole.text.index(stop)] and cut.finish_reason == "stop"
    assert cut.completion_token_ids == whole.completion_token_ids[: len(cut.completion_token_ids)]  # ids: a prefix, to the stop


BAD_REQUESTS = [
    # (body, extra headers, status, error code or param)
    (b"{not json", {}, 400, None),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "q"}], "n": 5}), {}, 400, "n"),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "q" * 300}]}), {}, 400, "context_length_exceeded"),
    (
        json.dumps({"model": "policy", "messages": [{"role": "user", "content": "q"}], "max_tokens": 10_000}),
        {},
        400,
        "context_length_exceeded",
    ),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "q"}], "stream": True}), {}, 400, "unsupported_parameter"),
    (
        json.dumps({"model": "policy", "messages": [{"role": "user", "content": "q"}], "presence_penalty": 1}),
        {},
        400,
        "unsupported_parameter",
    ),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "q"}], "frobnicate": 1}), {}, 400, "frobnicate"),
    (json.dumps({"model": "policy", "messages": []}), {}, 400, "messages"),
    (json.dumps({"model": "policy"}), {}, 400, "messages"),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "q"}], "temperature": 7}), {}, 400, "temperature"),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "q"}], "max_tokens": True}), {}, 400, "max_tokens"),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "q"}], "seed": "7"}), {}, 400, "seed"),
    (
        json.dumps({"model": "policy", "messages": [{"role": "user", "content": "q"}], "max_tokens": 3, "max_completion_tokens": 5}),
        {},
        400,
        "max_tokens",
    ),
    (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "q"}]}), {}, 404, "model_not_found"),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "q"}]}), {"X-Session-Id": "ended"}, 409, "session_ended"),
]


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(server):
    headers = {"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"}
    server.sessions.end(server.sessions.open("ended"))
    for body, extra, status, code in BAD_REQUESTS:
        answer = httpx.post(f"{server.base_url}/chat/completions", headers={**headers, **extra}, content=body, timeout=60)
        error = answer.json()["error"]
        assert answer.status_code == status, (body, answer.text)
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert code is None or code in (error["code"], error["param"]), (body, error)
        if status == 409:  # final: the openai client retries a 409 (twice, with back-off) unless told not to
            assert answer.headers.get("x-should-retry") == "false"
    for body in (b"", b"[1, 2]", b'"text"'):  # said "Missing required parameter: ''" / "Invalid value for 'None'"
        answer = httpx.post(f"{server.base_url}/chat/completions", headers=headers, content=body)
        assert answer.status_code == 400 and answer.json()["error"]["message"] == "The request body must be a JSON object.", body
    # curl -d sends a valid object as form data: it was told the body is no JSON object
    form = {"Authorization": headers["Authorization"], "Content-Type": "application/x-www-form-urlencoded"}
    answer = httpx.post(f"{server.base_url}/chat/completions", headers=form, content=b'{"model": "policy", "messages": []}')
    assert answer.status_code == 400 and "'Content-Type: application/json'" in answer.json()["error"]["message"]
    # a lone surrogate escape (valid JSON) was a 500, which the openai client retries
    lone = b'{"model": "policy", "messages": [{"role": "user", "content": "\\ud800"}]}'
    answer = httpx.post(f"{server.base_url}/chat/completions", headers=headers, content=lone)
    assert answer.status_code == 400 and "unpaired UTF-16 surrogate" in answer.json()["error"]["message"], answer.text
    unknown = httpx.post(f"{server.base_url}/sessions/never-opened/end", headers=headers, content=b"{}")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "session_not_found"
    slashed = httpx.post(f"{server.base_url}/sessions", headers=headers, json={"session_id": "run-7/episode-1"}).json()["id"]
    ended = httpx.post(f"{server.base_url}/sessions/{slashed}/end", headers=headers, content=b"{}")  # was a bare 404
    assert ended.status_code == 200, ended.text
    # The metadata keys the server reads must be integers: {"seed": "experiment-7"} made every call of it a 500
    for key, value in (("seed", "experiment-7"), ("token_budget", "unlimited"), ("seed", -1), ("token_budget", True)):
        opened = httpx.post(f"{server.base_url}/sessions", headers=headers, json={"metadata": {key: value}})
        assert opened.status_code == 400 and opened.json()["error"]["param"] == f"metadata.{key}", opened.text
    seeded = httpx.post(f"{server.base_url}/sessions", headers=headers, json={"metadata": {"seed": 7, "note": "x"}})
    assert seeded.status_code == 200
    server.sessions.auto_create = False  # a training run's server: only the sessions it opened
    try:
        with pytest.raises(openai.NotFoundError) as stranger:
            chat(client(server, "stranger"), [{"role": "user", "content": "q"}], max_tokens=4)
        assert stranger.value.code == "session_not_found"
    finally:
        server.sessions.auto_create = True
    with pytest.raises(openai.BadRequestError) as too_many:
        chat(client(server), [{"role": "user", "content": "q"}], n=99)
    assert too_many.value.status_code == 400 and too_many.value.param == "n"
    ended = httpx.post(f"{server.base_url}/sessions/ended/end", headers=headers, content=b'{"reward": 1.0}')
    assert ended.status_code == 200 and ended.json()["rejected"] == "the session recorded no calls"
    assert chat(client(server), [{"role": "user", "content": "q"}], max_tokens=4).choices[0].message.role == "assistant"


def test_a_training_runs_server_samples_with_the_runs_settings_its_own_seeds_and_within_each_budget(engine, tokenizer):
    """A run's sessions: a request's temperature / top_p / top_k must be the run's (the trainer scores under them; an
    agent's 0.7 was sampled and trained at 1.0), an agent's fixed seed must not make a group's sessions identical
    (without session seeds it did), and the call that reaches a session's token budget stops there (it sampled past
    it, and the whole session then got the failure reward)."""
    from nemo_like.serving.protocol import ChatCompletionRequest
    from nemo_like.serving.service import RunSampling

    request = ChatCompletionRequest(model="policy", messages=[{"role": "user", "content": "q"}], top_k=-1)
    RunSampling(0.7, 0.9, None, enforce=True).apply(request)  # unset: the run's; top_k -1 is off, as the run's None
    params = request.sampling_params(8)
    assert (params.temperature, params.top_p, params.top_k, params.greedy) == (0.7, 0.9, None, False)

    config = ServerConfig(require_session=True, auto_create_sessions=False, run_sampling=RunSampling(enforce=True))
    with RolloutServer(engine, tokenizer, config) as srv:
        headers = {"Authorization": f"Bearer {srv.api_key}"}

        def session(**metadata) -> str:
            opened = httpx.post(f"{srv.base_url}/sessions", headers=headers, json={"metadata": metadata})
            assert opened.status_code == 200, opened.text
            return opened.json()["id"]

        ask = [{"role": "user", "content": "What is 12 times 3?"}]
        for param, sent in (("temperature", {"temperature": 0.5}), ("temperature", {"temperature": 0}), ("top_p", {"top_p": 0.9})):
            with pytest.raises(openai.BadRequestError) as refused:
                chat(client(srv, session()), ask, max_tokens=4, **sent)
            assert refused.value.code == "sampling_mismatch" and refused.value.param == param, sent
        with pytest.raises(openai.BadRequestError) as refused:
            chat(client(srv, session()), ask, max_tokens=4, extra_body={"top_k": 20})
        assert refused.value.code == "sampling_mismatch" and refused.value.param == "top_k"
        drawn = {
            tuple(chat(client(srv, session()), ask, max_tokens=8, seed=7).choices[0].model_extra["completion_token_ids"]) for _ in range(4)
        }
        assert len(drawn) > 1  # the agent's seed=7 is not the sessions' seed
        budgeted = client(srv, session(token_budget=3, seed=0))  # seeded: its first reply runs into the budget
        first = chat(budgeted, ask, max_tokens=8).choices[0]
        assert len(first.model_extra["completion_token_ids"]) == 3 and first.finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as spent:
            chat(budgeted, ask, max_tokens=8)
        assert spent.value.code == "session_budget_exceeded"
