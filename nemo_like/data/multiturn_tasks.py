"""Seeded prompt generators for the multi-turn tasks, and the shipped prompt sets built from them.

* ``tool-arith`` (task ``tool``): multiplications of a 3-digit by a 2-digit number, e.g.
  ``"What is 347 times 28?"`` -> ``9716``. Too hard for the shipped tiny model to answer directly; the
  calculator tool makes it a copy task. Train/validation are disjoint by operand pair (a seed-independent
  hash, as in :mod:`nemo_like.data.arithmetic`).
* ``guess-number`` (task ``guess_number``): ``"Guess my number from 1 to 100. Reply with one integer only. ..."``
  (the prompt states the game's rules: a turn that is not one integer ends it); the secret is the answer.
  The secret space is small, so the splits differ by seed only.

``scripts/build_multiturn_datasets.py`` writes both as JSONL (columns ``problem``, ``answer``, ``task``) under
``nemo_like/assets/multiturn-tasks/``; ``data.dataset_name: tool-arith`` / ``guess-number`` reads them.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Literal

Split = Literal["train", "validation"]
VALIDATION_PERCENT = 20
MULTIPLY_TEMPLATES = ("What is {a} times {b}?", "Compute {a} * {b}.", "Multiply {a} by {b}.")
# What the game's scoring needs said (environments/games/guess_number.py): a turn that is not one integer ends the game
GUESS_TEMPLATE = (
    "Guess my number from {low} to {high}. Reply with one integer only. After a wrong guess I say higher (my number is "
    "larger) or lower (it is smaller)."
)
ASSET_DIR = Path(__file__).resolve().parents[1] / "assets" / "multiturn-tasks"


def _bucket(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % 100


def multiply_split(a: int, b: int) -> Split:
    """The split of the operand pair ``(a, b)`` (hash-based, seed-independent)."""
    return "validation" if _bucket(f"*|{a}|{b}") < VALIDATION_PERCENT else "train"


def make_multiply_problems(n: int, seed: int, split: Split) -> list[dict[str, str]]:
    """``n`` rows ``{problem, answer, task: "tool"}`` of ``split``, deterministic in ``seed``.

    Operands: ``a`` in 100..999, ``b`` in 10..99, drawn uniformly until a pair of ``split`` comes up."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    rng = random.Random(f"multiply/{split}/{seed}")
    rows = []
    while len(rows) < n:
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        if multiply_split(a, b) != split:
            continue
        rows.append({"problem": rng.choice(MULTIPLY_TEMPLATES).format(a=a, b=b), "answer": str(a * b), "task": "tool"})
    return rows


def make_guess_number_problems(n: int, seed: int, low: int = 1, high: int = 100) -> list[dict[str, str]]:
    """``n`` rows ``{problem, answer, task: "guess_number"}`` with secrets uniform in ``low..high``."""
    if low > high:
        raise ValueError(f"low ({low}) must not exceed high ({high})")
    rng = random.Random(f"guess/{seed}")
    prompt = GUESS_TEMPLATE.format(low=low, high=high)
    return [{"problem": prompt, "answer": str(rng.randint(low, high)), "task": "guess_number"} for _ in range(n)]


def write_jsonl(rows: list[dict[str, str]], path: Path) -> None:
    """Write ``rows`` as JSON lines (sorted keys, so rebuilding gives the same bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
