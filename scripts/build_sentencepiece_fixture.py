#!/usr/bin/env python
"""Deterministically build ``tests/fixtures/tiny_sentencepiece/tokenizer.model``: a 384-piece SentencePiece
(unigram) tokenizer for the rollout server's tests, trained offline on generated arithmetic and chat text.

It exists for one property byte-level BPE lacks: SentencePiece prefixes a piece at the start of every separately
encoded text with ``▁`` (a space), so a prompt spliced from a session's earlier ids plus the remainder tokenised on
its own would hold a space the rendered text does not (``tests/functional/test_rollout_server.py``). The chat markers
and the newline are atomic pieces; any other character falls back to its bytes (256 byte pieces); no normalisation, so decode(encode(s)) == s.

Usage: python scripts/build_sentencepiece_fixture.py [--out tests/fixtures/tiny_sentencepiece]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import tempfile
from pathlib import Path

import sentencepiece as spm

ROOT = Path(__file__).resolve().parents[1]
SYMBOLS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "\n"]


def corpus(lines: int = 3000, seed: int = 0) -> str:
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        a, b = rng.randint(1, 999), rng.randint(1, 99)
        out.append(f"What is {a} times {b}? The answer is {a * b}. Let me call the calculator tool with {a}*{b}.")
        out.append(f"user assistant system tool You are a helpful assistant. Today is day {i % 30}.")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "tiny_sentencepiece")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # Relative paths: the trainer records them in the model, so an absolute temporary path would change its bytes.
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        Path("corpus.txt").write_text(corpus())
        spm.SentencePieceTrainer.train(
            input="corpus.txt", model_prefix="tokenizer", vocab_size=384, model_type="unigram",
            user_defined_symbols=SYMBOLS, pad_id=0, unk_id=1, bos_id=2, eos_id=3, byte_fallback=True,
            character_coverage=1.0, normalization_rule_name="identity", num_threads=1, minloglevel=2,
        )  # fmt: skip
        shutil.copyfile("tokenizer.model", args.out / "tokenizer.model")
    print(f"wrote {args.out / 'tokenizer.model'}")


if __name__ == "__main__":
    main()
