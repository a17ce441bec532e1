#!/usr/bin/env python
"""Deterministically build ``nemo_like/assets/tiny-reward-qwen2``: a tiny sequence-classification reward model
(``Qwen2ForSequenceClassification``, ``num_labels=1``) for the ``reward_model`` environment's tests and demo.

1. backbone: the shipped ``tiny-arith-qwen2`` weights (same config, same tokenizer and chat template), copied
   unchanged;
2. score head (``score``, 128 -> 1, no bias): a linear probe fitted with a fixed seed on the backbone's pooled
   last-token features of ``user: <problem> / assistant: <answer>`` conversations, the gold answer labelled 1 and a
   wrong answer (gold +- 1..9) labelled 0 (logistic loss, Adam, ``--steps`` full-batch steps): the model scores
   correct answers higher, though far from perfectly (the accuracy on held-out pairs is in ``build_info.json``).

The conversation is rendered by the chat template without a generation prompt (the last token is the newline the
template writes after the assistant turn's ``<|im_end|>``), as :mod:`nemo_like.environments.reward_model` renders it.

Usage:
  python scripts/build_tiny_reward_model.py [--out DIR] [--seed S] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from nemo_like.data.arithmetic import make_arithmetic_problems

REPO_ROOT = Path(__file__).resolve().parents[1]
BASE = REPO_ROOT / "nemo_like" / "assets" / "tiny-arith-qwen2"
DEFAULT_OUT = REPO_ROOT / "nemo_like" / "assets" / "tiny-reward-qwen2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def conversations(n: int, seed: int, split: str) -> tuple[list[list[dict[str, str]]], list[float]]:
    """``2n`` (problem, answer) conversations: each problem once with its gold answer (label 1), once wrong (0)."""
    rng = random.Random(f"reward/{split}/{seed}")
    convs, labels = [], []
    for p in make_arithmetic_problems(n, seed, split):
        wrong = p.answer + rng.choice([-1, 1]) * rng.randint(1, 9)
        for answer, label in ((p.answer, 1.0), (wrong, 0.0)):
            convs.append([{"role": "user", "content": p.prompt}, {"role": "assistant", "content": str(answer)}])
            labels.append(label)
    return convs, labels


@torch.no_grad()
def pooled_features(model: Qwen2ForSequenceClassification, tok, convs: list[list[dict[str, str]]]) -> torch.Tensor:
    """The backbone's final hidden state at each conversation's last token, ``[N, hidden]`` (one at a time: exact)."""
    rows = []
    for conv in convs:
        ids = tok.apply_chat_template(conv, tokenize=False)
        input_ids = torch.tensor([tok(ids, add_special_tokens=False)["input_ids"]])
        rows.append(model.model(input_ids=input_ids).last_hidden_state[0, -1])
    return torch.stack(rows)


def fit_head(model: Qwen2ForSequenceClassification, feats: torch.Tensor, labels: torch.Tensor, steps: int) -> None:
    """Logistic regression of ``labels`` on ``feats`` through the score head (full batch, Adam)."""
    head = model.score
    opt = torch.optim.Adam(head.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head(feats).squeeze(-1), labels)
        loss.backward()
        opt.step()


def accuracy(model: Qwen2ForSequenceClassification, feats: torch.Tensor) -> float:
    """Share of (gold, wrong) pairs where the gold answer scores higher."""
    with torch.no_grad():
        scores = model.score(feats).squeeze(-1)
    return (scores[0::2] > scores[1::2]).float().mean().item()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--train-problems", type=int, default=512)
    p.add_argument("--eval-problems", type=int, default=256)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    config = Qwen2Config.from_pretrained(BASE)
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    model = Qwen2ForSequenceClassification(config).eval()
    model.model.load_state_dict(Qwen2ForCausalLM.from_pretrained(BASE).model.state_dict())
    torch.nn.init.normal_(model.score.weight, std=config.hidden_size**-0.5)
    tok = AutoTokenizer.from_pretrained(BASE)
    train_convs, train_labels = conversations(args.train_problems, args.seed, "train")
    eval_convs, _ = conversations(args.eval_problems, args.seed, "validation")
    train_feats = pooled_features(model, tok, train_convs)
    eval_feats = pooled_features(model, tok, eval_convs)
    fit_head(model, train_feats, torch.tensor(train_labels), args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(BASE / name, args.out / name)
    info = {
        "script": "scripts/build_tiny_reward_model.py",
        "seed": args.seed,
        "base": "tiny-arith-qwen2",
        "head_steps": args.steps,
        "train_pairs": args.train_problems,
        "pairwise_accuracy": {"train": accuracy(model, train_feats), "validation": accuracy(model, eval_feats)},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (args.out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
