"""Build the shipped ``math-tiny`` prompt set: ``nemo_like/assets/math-tiny/{train,validation}.jsonl``.

The problems are the arithmetic task's word problems ("What is 12 plus 7?", operands 0..99, ``+`` and
``-`` with ``a >= b``), the kind the shipped tiny model answers with a bare integer, so RL on them
can show learning on a CPU. The gold answers, though, are written in varied LaTeX/number forms
("19", "19.0", "\\frac{38}{2}", "\\dfrac{57}{3}", "+19"), so a reward must compare values (math-verify),
not strings. The split reuses the arithmetic task's hash of the operand tuple, so no validation
problem appears in training. Output is deterministic: rebuilding gives byte-identical files.

Run from the repository root: ``python scripts/build_math_dataset.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from nemo_like.data.arithmetic import make_arithmetic_problems  # noqa: E402

#: Rows per split and the generator seed of each.
SPLITS = {"train": (4000, 11), "validation": (500, 12)}
#: Gold-answer forms and their weights (percent).
FORMS = {"integer": 40, "decimal": 20, "frac": 20, "dfrac": 15, "plus_sign": 5}
TASK_NAME = "math"
DEFAULT_OUT = REPO_ROOT / "nemo_like" / "assets" / "math-tiny"


def render_answer(value: int, form: str, rng: random.Random) -> str:
    """``value`` written in ``form`` (every form denotes exactly ``value``)."""
    if form == "integer":
        return str(value)
    if form == "decimal":
        return f"{value}.{'0' * rng.randint(1, 2)}"
    if form in ("frac", "dfrac"):
        d = rng.randint(2, 9)
        return f"\\{form}{{{value * d}}}{{{d}}}"
    if form == "plus_sign":
        return f"+{value}"
    raise ValueError(f"unknown answer form {form!r}")


def build_rows(split: str) -> list[dict[str, str]]:
    """The rows of ``split``: problem, gold answer (a varied form), task."""
    n, seed = SPLITS[split]
    rng = random.Random(f"math-tiny/{split}/{seed}")
    forms, weights = list(FORMS), list(FORMS.values())
    rows = []
    for problem in make_arithmetic_problems(n, seed=seed, split=split):
        form = rng.choices(forms, weights)[0]
        rows.append({"problem": problem.prompt, "answer": render_answer(problem.answer, form, rng), "task": TASK_NAME})
    return rows


def write_jsonl(rows: list[dict[str, str]], path: Path) -> None:
    """One JSON object per line, fixed key order, UTF-8, '\\n' line ends."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"Output directory (default: {DEFAULT_OUT}).")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        path = args.out / f"{split}.jsonl"
        rows = build_rows(split)
        write_jsonl(rows, path)
        print(f"{path}: {len(rows)} rows, {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
