"""The reward-model environment against a plain transformers forward of the shipped tiny reward model: same
scores (< 1e-5) whatever the token budget (batch split) and the order; normalisation, truncation and config errors."""

from __future__ import annotations

import math
import random

import pytest
import torch

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import MasterConfig
from nemo_like.environments.learned_inputs import prompt_of, resolve_reward_model_path
from nemo_like.environments.registry import resolve_environments
from nemo_like.environments.reward_model import TINY_REWARD_MODEL, RewardModelEnvironment
from nemo_like.environments.reward_model_scorer import token_budget_batches
from nemo_like.environments.score_normalization import ScoreNormalization

PROMPTS = ["What is 3 + 4?", "Compute 12 minus 5.", "What is 6 times 7?", "Add 19 and 23."]
RESPONSES = ["7", "8", "42", "The answer is 42, I think", "", "1" * 40, "7", "seven"]


@pytest.fixture(scope="module")
def env() -> RewardModelEnvironment:
    return RewardModelEnvironment(model_name=TINY_REWARD_MODEL)


@pytest.fixture(scope="module")
def batch() -> tuple[list[str], list[dict]]:
    metadata = [{"prompt": PROMPTS[i % len(PROMPTS)], "task_name": "rm"} for i in range(len(RESPONSES))]
    return list(RESPONSES), metadata


def plain_forward_scores(responses: list[str], metadata: list[dict]) -> list[float]:
    """Each pair alone through AutoModelForSequenceClassification, as its model card would run it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = resolve_reward_model_path(TINY_REWARD_MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    scores = []
    with torch.no_grad():
        for response, meta in zip(responses, metadata):
            conv = [{"role": "user", "content": meta["prompt"]}, {"role": "assistant", "content": response}]
            ids = tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False, return_tensors="pt")["input_ids"]
            scores.append(model(input_ids=ids).logits[0, 0].item())
    return scores


def test_scores_equal_a_plain_forward_whatever_the_batch_split_and_order(env, batch) -> None:
    responses, metadata = batch
    reference = plain_forward_scores(responses, metadata)
    assert len(set(reference)) > 4  # the pairs really score differently
    worst = 0.0
    for budget in (1, 40, 100, 10**6):  # one sample per batch ... everything in one batch
        env.cfg.max_tokens_per_batch = budget
        for seed in (None, 0, 1):
            order = list(range(len(responses)))
            if seed is not None:
                random.Random(seed).shuffle(order)
            raw = env.raw_scores([responses[i] for i in order], [metadata[i] for i in order])
            worst = max(worst, max(abs(raw[k] - reference[i]) for k, i in enumerate(order)))
        assert env.metrics()["batches"] >= 1
    env.cfg.max_tokens_per_batch = 4096
    print(f"max |reward model score - plain transformers forward| = {worst:.3g}")
    assert worst < 1e-5


def test_rewards_are_the_normalised_scores_and_counters_add_up(batch) -> None:
    responses, metadata = batch
    norm = {"shift": 0.1, "scale": 4.0, "squash": "sigmoid", "clip": [0.05, 0.95]}
    env = RewardModelEnvironment(model_name=TINY_REWARD_MODEL, normalize=norm, max_tokens_per_batch=64)
    raw = plain_forward_scores(responses, metadata)
    rewards = env.score(responses, [*metadata[:-1], {"task_name": "rm"}])  # the last sample has no prompt
    expected = [min(max(1 / (1 + math.exp(-4.0 * (r - 0.1))), 0.05), 0.95) for r in raw[:-1]]
    assert rewards[:-1] == pytest.approx(expected, abs=1e-5)
    counters = env.metrics()
    assert counters["scored"] == len(responses) and counters["prompt_missing"] == 1.0
    assert counters["score_sum"] == pytest.approx(sum(raw[:-1]) + env.raw_scores(responses[-1:], [{"prompt": ""}])[0], abs=1e-4)
    assert env.metrics()["scored"] == 0.0  # reset by each metrics() call; raw_scores alone scores nothing


def test_long_inputs_keep_their_last_tokens_and_are_counted(env, batch) -> None:
    responses, metadata = batch
    short = RewardModelEnvironment(model_name=TINY_REWARD_MODEL, max_length=6)
    ids = env.scorer.encode(metadata[0]["prompt"], responses[0], use_chat_template=True)
    assert len(ids) > 6
    full = env.scorer.score([ids[-6:]], 4096)[0]
    assert short.raw_scores(responses[:1], metadata[:1]) == pytest.approx([full], abs=1e-6)
    assert short.metrics()["truncated"] == 1.0


def test_token_budget_batches_cover_every_index_once_within_the_budget() -> None:
    lengths = [5, 9, 1, 9, 3, 30, 4]
    for budget in (1, 10, 18, 27, 1000):
        batches = token_budget_batches(lengths, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget
    assert token_budget_batches(lengths, 18) == [[5], [1, 3], [0, 6, 4], [2]]  # 30; 2x9; 3x5; 1


def test_normalisation_steps() -> None:
    assert ScoreNormalization()(1.5) == 1.5
    assert ScoreNormalization(shift=1.0, scale=2.0)(3.0) == 4.0
    assert ScoreNormalization(squash="tanh")(0.5) == pytest.approx(math.tanh(0.5))
    assert ScoreNormalization(squash="sigmoid")(-1000.0) == 0.0
    assert ScoreNormalization(clip=(-1.0, 1.0))(3.0) == 1.0


def test_prompt_from_metadata() -> None:
    assert prompt_of({"prompt": "p"}) == "p"
    assert prompt_of({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}) == "a"
    assert prompt_of({"answer": 3}) is None


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"model_nam": "x"}, "env.rm.model_nam: unknown key. Did you mean 'model_name'?"),
        ({"model_name": "./no/such/dir"}, "env.rm.model_name"),
        ({"normalize": {"scale": 0}}, "env.rm.normalize: scale must not be 0"),
        ({"normalize": {"clip": [1, 0]}}, "env.rm.normalize: clip must be [low, high]"),
        ({"max_tokens_per_batch": 0}, "env.rm.max_tokens_per_batch"),
    ],
)
def test_bad_sections_name_the_key(section: dict, message: str) -> None:
    cfg = MasterConfig.model_validate({"env": {"rm": {"class": "reward_model", **section}}})
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
        resolve_environments(cfg.env_sections)
