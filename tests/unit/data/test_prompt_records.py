"""The built-in arithmetic prompts are unchanged by the datasets layer, and carry the metadata contract."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from nemo_like.config import ConfigError, load_config
from nemo_like.config.schema import EMBEDDED_MODEL
from nemo_like.data.prompts import build_prompt_dataset
from nemo_like.models.loading import load_tokenizer

TINY = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_tiny_cpu.yaml"

# Recorded with the code before the datasets layer existed (same recipe and tokenizer; train cut to its first
# 2,000 problems to keep this fast, the generator being prefix-stable): the tiny demo's prompts, ids, tokens
# and answers must not move. (All 20,000 train prompts hashed to b221366e...f1c33 then and now.)
ANCHORS = {
    "train": (2000, "f768687b33aa6987f507a1ec0aca330eb5ca3bc24d58203e36cb11da118a9a1a"),
    "validation": (256, "65787ac3370774dd5c7d5f1e626a18570356a05552a5c55ab4fa60ed42c8eb94"),
}
FIRST = {
    "train": [("train-1-0", "What is the sum of 87 and 86?", 173), ("train-1-1", "Compute 14 - 13.", 1)],
    "validation": [("validation-2-0", "What is 42 minus 41?", 1), ("validation-2-1", "Add 25 and 70.", 95)],
}


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(TINY, ["data.train.num_problems=2000"])
    return cfg, load_tokenizer(cfg.policy.model_name)


@pytest.mark.parametrize("split", ["train", "validation"])
def test_arithmetic_prompts_are_unchanged(tiny, split):
    cfg, tok = tiny
    records = build_prompt_dataset(cfg.data, tok, split, 56)
    got = [(r.id, r.messages[-1]["content"], r.metadata["answer"]) for r in records[:2]]
    assert got == FIRST[split]
    blob = json.dumps([[r.id, r.messages, r.prompt_token_ids, r.metadata["answer"]] for r in records]).encode()
    assert (len(records), hashlib.sha256(blob).hexdigest()) == ANCHORS[split]
    assert all(r.metadata["task_name"] == "arithmetic" and type(r.metadata["answer"]) is int for r in records)


def test_arithmetic_accepts_a_system_prompt_file(tiny, tmp_path):
    cfg, tok = tiny
    (tmp_path / "sys.txt").write_text("Answer with a single integer.\n")
    data = cfg.data.model_copy(update={"system_prompt_file": str(tmp_path / "sys.txt")})
    record = build_prompt_dataset(data, tok, "validation", 56)[0]
    assert record.messages == [
        {"role": "system", "content": "Answer with a single integer."},
        {"role": "user", "content": "What is 42 minus 41?"},
    ]


def test_a_tokenizer_without_a_chat_template_is_a_config_error_naming_the_keys(tiny, tmp_path):
    cfg, tok = tiny
    # A base model's tokenizer: the tiny model's, saved without its chat template (it used to end in transformers'
    # ValueError traceback from apply_chat_template).
    base = load_tokenizer(EMBEDDED_MODEL)
    base.chat_template = None
    base.save_pretrained(tmp_path / "base")
    no_template = load_tokenizer(str(tmp_path / "base"))
    assert not no_template.chat_template
    with pytest.raises(
        ConfigError, match=r"policy\.tokenizer_name.*has no chat template.*rendered with the tokenizer.s chat template"
    ) as err:
        build_prompt_dataset(cfg.data, no_template, "validation", 56)
    assert str(tmp_path / "base") in str(err.value) and "policy.model_name" in str(err.value)
