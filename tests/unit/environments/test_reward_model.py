"""The reward-model environment against a plain transformers forward of the shipped tiny reward model: same
scores (< 1e-5) whatever the token budget (batch split) and the order; normalisation, truncation and config errors."""

from __future__ import annotations

import json
import math
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import MasterConfig
from nemo_like.environments.learned_inputs import cut_from_left, prompt_of, resolve_reward_model_path
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


def tiny_rm_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(resolve_reward_model_path(TINY_REWARD_MODEL), tmp_path / "rm"))


def test_a_response_the_chat_template_rewrites_is_a_counted_template_error_not_a_crash(tmp_path: Path) -> None:
    """A reward model whose template drops the text before ``</think>`` (DeepSeek-R1-distill's rule): one such response
    raised out of the scoring call and stopped the training step."""
    model_dir = tmp_path / "drops_reasoning"
    shutil.copytree(resolve_reward_model_path(TINY_REWARD_MODEL), model_dir)
    (model_dir / "chat_template.jinja").write_text(
        "{% for message in messages %}{% set content = message['content'] %}"
        "{% if message['role'] == 'assistant' and '</think>' in content %}{% set content = content.split('</think>')[-1] %}"
        "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}{% endfor %}"
    )
    env = RewardModelEnvironment(model_name=str(model_dir), template_error_reward=-1.0)
    metadata = [{"prompt": "What is 3 + 4?"}] * 3
    alone = env.score(["7", "8"], metadata[:2])
    env.metrics()
    assert env.score(["7", "<think>3+4=7</think>7", "8"], metadata) == [alone[0], -1.0, alone[1]]
    counts = env.metrics()
    assert (counts["template_errors"], counts["scored"]) == (1.0, 2.0)
    assert env.score(["<think>x</think>7"], metadata[:1]) == [-1.0] and env.metrics()["batches"] == 0.0  # nothing to run


def test_a_checkpoint_without_a_trained_score_head_is_refused_at_load(tmp_path: Path) -> None:
    """transformers gives a checkpoint without the head a random one and says so only in the actor's log: the scores
    were noise, a different noise in every actor. A causal LM that calls itself a classifier passes the config's check
    (its architectures) and is refused by the load, naming the missing weights."""
    from nemo_like.models.assets import embedded_model_path

    directory = tmp_path / "causal-as-classifier"
    shutil.copytree(embedded_model_path("embedded:tiny-arith-qwen2"), directory)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["Qwen2ForSequenceClassification"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"not a trained sequence-classification model: its checkpoint has no score\.weight"):
        RewardModelEnvironment(model_name=str(directory))


def test_a_model_without_a_configured_pad_pools_each_sequence_at_its_own_last_token(tmp_path: Path) -> None:
    """Config without pad_token_id, tokenizer pad = eos, a template whose turns end with eos (as Llama-3's end with
    <|eot_id|>): batched scores equal single forwards, which pool the final eos (padding with eos read the token
    before it: -1.0004 against 0.2993 for the first pair)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    directory = tiny_rm_copy(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["pad_token_id"] = None
    (directory / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((directory / "tokenizer_config.json").read_text())
    tok_config["pad_token"] = "<|im_end|>"  # the eos
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))
    template = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' }}{% endfor %}"
    (directory / "chat_template.jinja").write_text(template)

    env = RewardModelEnvironment(model_name=str(directory))
    responses, metadata = ["7", "The answer is 42", "8"], [{"prompt": p} for p in PROMPTS[:3]]
    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    assert model.config.pad_token_id is None and tok.pad_token_id == tok.eos_token_id
    plain = []
    with torch.no_grad():
        for response, meta in zip(responses, metadata):
            ids = env.scorer.encode(meta["prompt"], response, use_chat_template=True)
            assert ids[-1] == tok.eos_token_id  # the sequence ends with the tokenizer's pad
            plain.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    env.cfg.max_tokens_per_batch = 10**6  # one batch: the shorter rows are padded
    assert env.raw_scores(responses, metadata) == pytest.approx(plain, abs=1e-5)
    assert env.scorer.batches_run == 1 and env.scorer.model.config.pad_token_id not in {tok.eos_token_id, *env.scorer.encode("", "7", True)}


def build_encoder_reward_model(directory: Path, family: str, positions: int, tokenizer_limit: int) -> Path:
    """A tiny random BERT or RoBERTa sequence classifier (their classifier reads the first token, CLS) with a word-level
    tokenizer that wraps a text in [CLS] ... [SEP] (a text pair in [CLS] a [SEP] b [SEP], b's type id 1) and has no chat
    template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        PreTrainedTokenizerFast,
        RobertaConfig,
        RobertaForSequenceClassification,
    )

    words = ["[CLS]", "[PAD]", "[SEP]", "[UNK]", *"0123456789", *"abcdefghijklmnopqrstuvwxyz", "?", "+"]
    vocab = {w: i for i, w in enumerate(words)}  # [PAD] is 1: RoBERTa's padding index
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 0), ("[SEP]", 2)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        model_max_length=tokenizer_limit,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],  # as BERT's own tokenizer
    )
    tok.save_pretrained(directory)
    torch.manual_seed(0)
    shape = dict(vocab_size=len(words), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    shape.update(max_position_embeddings=positions, pad_token_id=1, num_labels=1)
    model = (
        BertForSequenceClassification(BertConfig(**shape)) if family == "bert" else RobertaForSequenceClassification(RobertaConfig(**shape))
    )
    model.save_pretrained(directory)
    return directory


def test_an_encoder_reward_model_keeps_its_cls_token_when_cut_and_concatenates_without_a_template(tmp_path: Path) -> None:
    directory = build_encoder_reward_model(tmp_path / "bert", "bert", positions=512, tokenizer_limit=512)
    with pytest.warns(UserWarning, match="use_chat_template has no effect"):  # the default asks for a template it lacks
        env = RewardModelEnvironment(model_name=str(directory), max_length=8)
    prompt, response = "what is 3 + 4 ? ", "a b c d e f g h i 7"
    ids = env.scorer.encode(prompt, response, use_chat_template=True)
    tok = env.scorer.tokenizer
    assert ids == tok(prompt + response)["input_ids"] and ids[0] == tok.cls_token_id and len(ids) > 8
    kept = ids[:1] + ids[-7:]  # CLS, then the response's end: what the classifier must read
    assert env.raw_scores([response], [{"prompt": prompt}]) == pytest.approx(env.scorer.score([kept], 4096), abs=1e-6)
    assert env.scorer.score([kept], 4096) != pytest.approx(env.scorer.score([ids[-8:]], 4096), abs=1e-4)  # CLS matters
    assert env.metrics()["truncated"] == 1.0


def test_a_text_pair_model_reads_prompt_and_response_as_its_tokenizer_pairs_them(tmp_path: Path) -> None:
    """``text_pair: true``: each (prompt, response) is the tokenizer's pair with its token type ids, as an encoder
    trained on pairs runs (OpenAssistant's DeBERTa reward models); the scores are those of a plain forward of
    ``tokenizer(prompt, response)`` whatever the batch split, a cut keeps CLS and the pair's last tokens with their
    types, and one segment (the concatenation) scores differently."""
    from transformers import AutoModelForSequenceClassification

    directory = build_encoder_reward_model(tmp_path / "bert", "bert", positions=512, tokenizer_limit=512)
    with torch.no_grad():  # BERT's init (std 0.02) scores every input alike: unit-scale weights make the inputs matter
        model = AutoModelForSequenceClassification.from_pretrained(directory)
        generator = torch.Generator().manual_seed(1)
        for weight in (p for p in model.parameters() if p.dim() > 1):
            weight.normal_(0.0, weight.shape[-1] ** -0.5, generator=generator)
        model.save_pretrained(directory)
    pairs = [("what is 3 + 4 ?", "7"), ("add 1 and 2", "the answer is 3"), ("what is 3 + 4 ?", "8 or 9 or 10"), ("q", "a b c d e f")]
    responses, metadata = [r for _, r in pairs], [{"prompt": p} for p, _ in pairs]
    env = RewardModelEnvironment(model_name=str(directory), text_pair=True)  # no warning: no template is asked for
    tok = env.scorer.tokenizer
    with torch.no_grad():
        reference = [model(**tok(p, r, return_tensors="pt")).logits[0, 0].item() for p, r in pairs]
    for budget in (1, 20, 4096):
        env.cfg.max_tokens_per_batch = budget
        assert env.raw_scores(responses, metadata) == pytest.approx(reference, abs=1e-5)
    one_segment = RewardModelEnvironment(model_name=str(directory), use_chat_template=False).raw_scores(responses, metadata)
    assert max(abs(a - b) for a, b in zip(one_segment, reference)) > 1e-2
    cut = RewardModelEnvironment(model_name=str(directory), text_pair=True, max_length=6)
    encoded = tok("add 1 and 2", "the answer is 3")
    ids, types = encoded["input_ids"], encoded["token_type_ids"]
    kept = {k: torch.tensor([v[:1] + v[-5:]]) for k, v in (("input_ids", ids), ("token_type_ids", types))}
    with torch.no_grad():
        expected = model(**kept, attention_mask=torch.ones_like(kept["input_ids"])).logits[0, 0].item()
    assert cut.raw_scores(["the answer is 3"], [{"prompt": "add 1 and 2"}]) == pytest.approx([expected], abs=1e-5)
    assert kept["token_type_ids"].tolist() == [[0, 1, 1, 1, 1, 1]] and cut.metrics()["truncated"] == 1.0
    with pytest.warns(UserWarning, match="no effect with text_pair"):
        RewardModelEnvironment(model_name=str(directory), text_pair=True, use_chat_template=True)


def test_a_cut_keeps_a_leading_cls_or_bos_and_otherwise_the_last_tokens(env, tmp_path: Path) -> None:
    encoder = RewardModelEnvironment(
        model_name=str(build_encoder_reward_model(tmp_path / "bert", "bert", 512, 512)), use_chat_template=False
    )
    cls = encoder.scorer.tokenizer.cls_token_id
    assert cut_from_left([cls, 5, 6, 7, 8, 2], 3, encoder.scorer.tokenizer) == [cls, 8, 2]
    assert cut_from_left([cls, 5, 6, 7, 8, 2], 1, encoder.scorer.tokenizer) == [2]  # no room for CLS and a token
    assert cut_from_left([5, 6, 7, 8, 2], 3, encoder.scorer.tokenizer) == [7, 8, 2]
    assert cut_from_left([5, 6, 7], 3, encoder.scorer.tokenizer) == [5, 6, 7]
    assert env.scorer.tokenizer.bos_token_id is None and cut_from_left([0, 5, 6, 7], 2, env.scorer.tokenizer) == [6, 7]


def test_the_tokenizer_limit_caps_the_input_below_roberta_s_position_table(tmp_path: Path) -> None:
    """RoBERTa's positions start after its padding index: 66 positions hold 64 tokens, as roberta-base's 514 hold 512."""
    directory = build_encoder_reward_model(tmp_path / "roberta", "roberta", positions=66, tokenizer_limit=64)
    env = RewardModelEnvironment(model_name=str(directory), use_chat_template=False)
    assert env.max_length == 64
    response = " ".join("7" * 100)
    (score,) = env.raw_scores([response], [{"prompt": ""}])  # an input cut to 66 tokens indexed past the table
    assert math.isfinite(score) and env.metrics()["truncated"] == 1.0


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
    with pytest.raises(ValueError, match=r"score 1e\+308 normalises to inf .*add a squash or a clip"):
        ScoreNormalization(scale=10.0)(1e308)  # a finite score, an inf reward
    assert ScoreNormalization(scale=10.0, squash="tanh")(1e308) == 1.0 and ScoreNormalization(scale=10.0, clip=(0, 5))(1e308) == 5
    with pytest.raises(ValueError, match="the raw score is nan"):  # it advised 'add a squash or a clip' with both set
        ScoreNormalization(squash="tanh", clip=(-0.9, 0.9))(float("nan"))
    for normalization in (ScoreNormalization(squash="sigmoid"), ScoreNormalization(clip=(-1.0, 1.0)), ScoreNormalization()):
        with pytest.raises(ValueError, match="the raw score is -?inf .*non-finite"):  # an overflow was the top reward
            normalization(float("inf"))
        with pytest.raises(ValueError, match="the raw score is -inf"):
            normalization(float("-inf"))
    # A clip around the squash's whole range never binds: a warning (it was silent), not an error (ablations flip keys)
    for squash, clip in (("tanh", (-5.0, 5.0)), ("sigmoid", (-1.0, 2.0)), ("tanh", (-1.0, 1.0))):
        with pytest.warns(UserWarning, match="has no effect"):
            ScoreNormalization(squash=squash, clip=clip)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ScoreNormalization(squash="tanh", clip=(0.0, 5.0))(-3.0) == 0.0  # binds below: no warning
        assert ScoreNormalization(squash="sigmoid", clip=(0.5, 1.0))(-3.0) == 0.5  # touching the range's edge: binds
    # A clip wholly outside the squash's range made every reward one constant, silently (no signal from the source)
    for squash, clip, constant in (("sigmoid", (1.0, 2.0), "1"), ("tanh", (-3.0, -1.0), "-1"), ("sigmoid", (-2.0, 0.0), "0")):
        with pytest.raises(ValueError, match=f"lies outside squash '{squash}''s range .*: every reward would be {constant} "):
            ScoreNormalization(squash=squash, clip=clip)


def test_prompt_from_metadata() -> None:
    assert prompt_of({"prompt": "p"}) == "p"
    assert prompt_of({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}) == "a"
    assert prompt_of({"answer": 3}) is None
    parts = [
        {"role": "user", "content": "old"},
        {"role": "user", "content": [{"type": "text", "text": "new"}, {"type": "text", "text": "er"}]},
    ]
    assert prompt_of({"messages": parts}) == "newer"  # the last user turn's text parts, not an older turn
    assert prompt_of({"messages": [parts[0], {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}) is None


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"model_nam": "x"}, "env.rm.model_nam: unknown key. Did you mean 'env.rm.model_name'?"),
        ({"model_name": "./no/such/dir"}, "env.rm.model_name"),
        ({"normalize": {"scale": 0}}, "env.rm.normalize: scale must not be 0"),
        ({"normalize": {"clip": [1, 0]}}, "env.rm.normalize: clip must be [low, high]"),
        ({"max_tokens_per_batch": 0}, "env.rm.max_tokens_per_batch"),
        ({"model_name": "embedded:tiny-arith-qwen2"}, "env.rm.model_name: 'embedded:tiny-arith-qwen2' is a causal language model"),
        # refused in the driver (each actor refused it as it loaded, naming no key)
        ({"label_index": 1}, "env.rm: label_index=1 but the reward model embedded:tiny-reward-qwen2 has 1 label"),
        ({"template_error_reward": float("nan")}, "env.rm.template_error_reward"),  # refused now, not at the first error
    ],
)
def test_bad_sections_name_the_key(section: dict, message: str) -> None:
    cfg = MasterConfig.model_validate({"env": {"rm": {"class": "reward_model", **section}}})
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
        resolve_environments(cfg.env_sections)


def test_a_cached_hub_id_of_a_causal_lm_is_refused_by_the_config(cached_hub_model: Path) -> None:
    """The config's check read config.json under the name as a path: a hub id in the local cache passed it."""
    from nemo_like.environments.reward_model import RewardModelEnvConfig

    with pytest.raises(ValueError, match="'acme/tiny-chat' is a causal language model"):
        RewardModelEnvConfig(model_name="acme/tiny-chat")
