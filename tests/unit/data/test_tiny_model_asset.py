"""Tests of the shipped tiny arithmetic model (``nemo_like/assets/tiny-arith-qwen2``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from nemo_like.data.arithmetic import format_messages, make_arithmetic_problems  # noqa: E402
from nemo_like.environments.arithmetic_reward import score_response  # noqa: E402
from nemo_like.models import assets  # noqa: E402
from nemo_like.models.assets import default_model_path  # noqa: E402

PAD_ID, IM_START_ID, EOS_ID = 0, 1, 2


@pytest.fixture(scope="module")
def model_dir() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_default_model_path_is_shipped_dir(model_dir: str) -> None:
    path = Path(model_dir)
    assert path.is_absolute() and path.name == "tiny-arith-qwen2" and path.parent.name == "assets"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "build_info.json",
    ):
        assert (path / name).is_file(), name
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 8 * 2**20


def test_missing_model_dir_error_names_path_and_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assets, "TINY_MODEL_DIRNAME", "no-such-model-dir")
    with pytest.raises(FileNotFoundError) as info:
        assets.default_model_path()
    assert "no-such-model-dir" in str(info.value)
    assert "scripts/build_tiny_model.py" in str(info.value)


def test_special_tokens(tokenizer) -> None:
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == PAD_ID
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == IM_START_ID
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == EOS_ID
    assert tokenizer.padding_side == "left"
    assert tokenizer.bos_token is None


def test_config_ids_and_size(model, model_dir: str) -> None:
    assert model.config.eos_token_id == EOS_ID and model.config.pad_token_id == PAD_ID
    assert model.generation_config.eos_token_id == EOS_ID
    assert model.generation_config.pad_token_id == PAD_ID
    assert model.config.tie_word_embeddings
    assert model.dtype == torch.float32
    n_params = sum(p.numel() for p in model.parameters())
    assert 500_000 < n_params < 3_000_000
    info = json.loads((Path(model_dir) / "build_info.json").read_text())
    assert info["num_params"] == n_params


def test_chat_template_and_digit_tokens(tokenizer) -> None:
    messages = [{"role": "user", "content": "What is 12 plus 7?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 12 plus 7?<|im_end|>\n<|im_start|>assistant\n"
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == "<|im_start|>user\nWhat is 12 plus 7?<|im_end|>\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == IM_START_ID and ids.count(EOS_ID) == 1
    assert tokenizer.decode(ids) == text
    digits = tokenizer("1907", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(digits) == ["1", "9", "0", "7"]


def test_greedy_decoding_solves_some_validation_problems(model, tokenizer) -> None:
    problems = make_arithmetic_problems(16, 0, "validation")
    prompts = [tokenizer.apply_chat_template(format_messages(p), add_generation_prompt=True, tokenize=False) for p in problems]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=8)
    new_tokens = out[:, enc["input_ids"].shape[1] :]
    texts = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    correct = sum(score_response(t, p.answer) for t, p in zip(texts, problems))
    assert correct >= 1, list(zip(texts, [p.answer for p in problems]))
    # every response is a bare integer followed by <|im_end|> (the trained format)
    assert all(EOS_ID in row.tolist() for row in new_tokens)
