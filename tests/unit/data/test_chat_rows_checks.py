"""Prompt building with a tokenizer that has a BOS, chat rows' checks and other keys, and whom a refusal blames.

Every test writes real files into ``tmp_path`` and builds records through ``build_prompt_dataset`` (the path
training takes) with real tokenizers: the shipped tiny Qwen2-style one, and the sentencepiece fixture loaded as a
Llama tokenizer, which adds a BOS. Chat templates are set on them as a model's would be.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest
from transformers import LlamaTokenizer

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import DataConfig
from nemo_like.data.prompts import PromptRecord, build_prompt_dataset
from nemo_like.models.loading import load_tokenizer

SENTENCEPIECE = Path(__file__).resolve().parents[2] / "fixtures" / "tiny_sentencepiece"
BUDGET = 500

# Llama-2 / Mistral / Gemma style: the template writes the BOS itself.
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)

# Qwen2.5-Instruct's rendering of an assistant's tool calls and of a tool's answer (its tool-list header left out).
TOOL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Accepts a system turn, refuses roles that do not alternate (Mistral / Llama-2 style check).
ALTERNATING_TEMPLATE = (
    "{% set convo = messages[1:] if messages[0]['role'] == 'system' else messages %}"
    "{% for m in convo %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def write_jsonl(path: Path, items: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def build(path: Path, tokenizer, prompt_key: str, **kw: Any) -> list[PromptRecord]:
    """The training records of the rows in ``path`` (every row, in file order)."""
    cfg = DataConfig(
        dataset_name=None,
        prompt_key=prompt_key,
        answer_key="a",
        shuffle=False,
        train={"data_path": str(path)},
        validation={"data_path": str(path)},
        **kw,
    )
    return build_prompt_dataset(cfg, tokenizer, "train", BUDGET)


def template_ids(tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """``apply_chat_template(..., tokenize=True, add_generation_prompt=True)``: the ids a prompt must have."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "input_ids") else ids)


@pytest.fixture
def tok():
    """The shipped tiny Qwen2-style tokenizer (no BOS), a fresh one per test: tests set their own chat template."""
    return load_tokenizer("embedded:tiny-arith-qwen2")


def test_a_template_that_writes_the_bos_gives_prompts_one_bos(tmp_path) -> None:
    """The tiny Qwen2 tokenizer has no BOS, so no other prompt test sees whether the rendered text is encoded with the
    tokenizer's special tokens: for a Llama/Mistral/Gemma tokenizer, whose template writes ``{{ bos_token }}``, that
    prompt starts with two BOS (the model reads a sequence it was never trained on)."""
    sp = LlamaTokenizer.from_pretrained(SENTENCEPIECE, add_bos_token=True, legacy=False)
    sp.chat_template = BOS_TEMPLATE
    bos = sp.bos_token_id
    assert sp("x")["input_ids"][0] == bos  # the tokenizer does add a BOS when asked for its special tokens
    text_rows = write_jsonl(tmp_path / "text.jsonl", [{"q": f"What is {i} plus 1?", "a": str(i + 1)} for i in range(3)])
    chat_rows = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "m": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "2+2?"}],
                "a": "4",
            }
        ],
    )
    records = [*build(text_rows, sp, "q", system_prompt="Be brief."), *build(chat_rows, sp, "m")]
    assert len(records) == 4
    for record in records:
        ids = record.prompt_token_ids
        assert ids[0] == bos and ids.count(bos) == 1, (record.id, ids[:4])
        assert ids == template_ids(sp, record.messages), record.id


def test_a_blank_last_user_turn_is_an_error_naming_the_row_as_a_blank_text_prompt_is(tmp_path, tok) -> None:
    """A text row of blanks was refused naming the row; a chat row whose question is blank built a prompt with an
    empty question."""
    text = write_jsonl(tmp_path / "text.jsonl", [{"q": "What is 1 plus 1?", "a": "2"}, {"q": "   ", "a": "1"}])
    with pytest.raises(ConfigError, match=r"row 2 of .*text.jsonl: the prompt \(column 'q', data.prompt_key\) is empty"):
        build(text, tok, "q")
    good = {"m": [{"role": "user", "content": "What is 1 plus 1?"}], "a": "2"}
    for blank in (
        [{"role": "user", "content": "   "}],
        [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "\n"}],
    ):
        chat = write_jsonl(tmp_path / "chat.jsonl", [good, good, {"m": blank, "a": "1"}])
        with pytest.raises(
            ConfigError, match=r"row 3 of .*chat.jsonl: the last 'user' turn of the chat messages \(data.prompt_key\) is empty"
        ):
            build(chat, tok, "m")
    earlier_blank = [{"role": "user", "content": ""}, {"role": "assistant", "content": "?"}, {"role": "user", "content": "2+2?"}]
    assert build(write_jsonl(tmp_path / "ok.jsonl", [{"m": earlier_blank, "a": "4"}]), tok, "m")  # only the question is checked


def test_a_chat_messages_other_keys_are_left_out_of_the_prompt_with_a_line_naming_them(tmp_path, tok, capsys) -> None:
    """``tool_calls``, ``tool_call_id`` and ``name`` were dropped silently: the prompt showed an empty assistant turn.
    They stay out (their shapes differ between formats and tables, and the rollout server normalises them), with a line
    naming them in the run's output; a Parquet table's None fill of a key no message holds is no such key. A chat log's
    timestamps (read as datetimes) no longer break the hash split of a carved validation set."""
    tok.chat_template = TOOL_TEMPLATE.replace("message.tool_calls", "message.tool_calls or []")
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expr": "347*28"}'}}
    messages = [
        {"role": "user", "content": "What is 347 times 28?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "9716", "tool_call_id": "call_1", "name": "calculator"},
        {"role": "user", "content": "So?"},
    ]
    plain = [{"role": "user", "content": "What is 2 plus 2?"}]
    path = write_jsonl(tmp_path / "tools.jsonl", [{"m": messages, "a": "9716"}, {"m": plain, "a": "4"}])
    capsys.readouterr()
    with_calls, _ = build(path, tok, "m")
    assert "tools.jsonl: the chat messages' keys ['name', 'tool_call_id', 'tool_calls'] are not passed" in capsys.readouterr().out
    kept = [{"role": m["role"], "content": m["content"]} for m in messages]
    assert with_calls.messages == kept and with_calls.prompt_token_ids == template_ids(tok, kept)
    datasets.Dataset.from_list([{"m": plain, "a": "4"}, {"m": [{"role": "user", "content": "hi", "name": None}], "a": "1"}]).to_parquet(
        str(tmp_path / "plain.parquet")
    )
    build(tmp_path / "plain.parquet", tok, "m")
    assert "are not passed" not in capsys.readouterr().out
    log = [{"m": [{"role": "user", "content": f"question {i}", "timestamp": f"2024-05-0{i + 1}T10:00:00"}], "a": str(i)} for i in range(8)]
    path = write_jsonl(tmp_path / "chat_log.jsonl", log)
    cfg = DataConfig(dataset_name=None, prompt_key="m", answer_key="a", train={"data_path": str(path)}, validation={"split_fraction": 0.25})
    assert build_prompt_dataset(cfg, tok, "train", BUDGET) and build_prompt_dataset(cfg, tok, "validation", BUDGET)


def test_a_refusal_blames_the_system_prompt_only_when_the_row_renders_without_it(tmp_path, tok) -> None:
    """With data.system_prompt set, every refusal said "unset data.system_prompt", also when the template takes the
    system turn and refuses the row's own messages (a user turn after a user turn)."""
    tok.chat_template = ALTERNATING_TEMPLATE
    rows = [
        {"m": [{"role": "user", "content": "q"}], "a": "1"},
        {"m": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "a": "2"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(
        ConfigError, match=r"refuses the prompt of row 2 of .*chat.jsonl \(data.train\): Conversation roles must alternate"
    ) as raised:
        build(path, tok, "m", system_prompt="Be brief.")
    assert "check the row's messages (data.prompt_key='m')" in str(raised.value) and "unset data.system_prompt" not in str(raised.value)
    # Gemma-2-it's template refuses any system turn: then the system prompt is the cause, and it is named.
    tok.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" + ALTERNATING_TEMPLATE
    )
    ok = write_jsonl(tmp_path / "ok.jsonl", rows[:1])
    with pytest.raises(ConfigError, match=r"row 1 of .*ok.jsonl \(data.train\): System role not supported; unset data.system_prompt"):
        build(ok, tok, "m", system_prompt="Be brief.")
    # Both refused: the row's own refusal, with the row's hint, and the system turn's too.
    with pytest.raises(
        ConfigError,
        match=r"row 1 of .*bad.jsonl \(data.train\): Conversation roles must alternate.* \(and with the system turn of data.system_prompt\(_file\): System role not "
        r"supported\); check the row's messages",
    ):
        build(write_jsonl(tmp_path / "bad.jsonl", rows[1:]), tok, "m", system_prompt="Be brief.")
