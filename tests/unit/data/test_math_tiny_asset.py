"""The shipped math-tiny set (nemo_like/assets/math-tiny): rebuilt byte-identical, gold answers right."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from nemo_like.data.arithmetic import TEMPLATES, split_of

REPO = Path(__file__).resolve().parents[3]
SHIPPED = REPO / "nemo_like" / "assets" / "math-tiny"
SCRIPT = REPO / "scripts" / "build_math_dataset.py"


def _template_regexes() -> list[tuple[str, re.Pattern]]:
    out = []
    for op, templates in TEMPLATES.items():
        for t in templates:
            pattern = re.escape(t).replace(r"\{a\}", r"(?P<a>\d+)").replace(r"\{b\}", r"(?P<b>\d+)")
            out.append((op, re.compile(f"^{pattern}$")))
    return out


REGEXES = _template_regexes()


def parse_problem(text: str) -> tuple[str, int, int]:
    """(op, a, b) of an arithmetic word problem, from the task's own templates."""
    matches = [(op, m) for op, rx in REGEXES if (m := rx.match(text))]
    assert len(matches) == 1, text
    op, m = matches[0]
    return op, int(m["a"]), int(m["b"])


def gold_value(answer: str) -> Fraction:
    """The number a gold answer denotes (only the forms the build script writes)."""
    if m := re.fullmatch(r"\+?(\d+)(?:\.0+)?", answer):
        return Fraction(int(m[1]))
    if m := re.fullmatch(r"\\d?frac\{(\d+)\}\{([1-9]\d*)\}", answer):
        return Fraction(int(m[1]), int(m[2]))
    raise AssertionError(f"unexpected gold form {answer!r}")


def read_rows(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_rebuild_is_byte_identical(tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], check=True, capture_output=True, cwd=tmp_path)
    for name in ("train.jsonl", "validation.jsonl"):
        assert (tmp_path / name).read_bytes() == (SHIPPED / name).read_bytes(), f"{name} differs: rebuild with {SCRIPT.name}"


@pytest.mark.parametrize("split,n", [("train", 4000), ("validation", 500)])
def test_gold_answers_denote_the_problem_value(split, n):
    rows = read_rows(SHIPPED / f"{split}.jsonl")
    assert len(rows) == n
    forms = Counter()
    for row in rows:
        assert set(row) == {"problem", "answer", "task"} and row["task"] == "math"
        op, a, b = parse_problem(row["problem"])
        assert split_of(op, a, b) == split  # the arithmetic task's hash split
        value = a + b if op == "+" else a - b
        assert value >= 0 and gold_value(row["answer"]) == value, row
        forms[re.sub(r"\d+", "N", row["answer"])] += 1
    assert {"N", "N.N", "\\frac{N}{N}", "\\dfrac{N}{N}", "+N"} <= set(forms)  # every form occurs
    assert forms["N"] < 0.5 * n  # mostly not the bare integer string


def test_splits_are_disjoint_and_small():
    def keys(split):
        return {
            (op, min(a, b), max(a, b)) if op == "+" else (op, a, b)
            for op, a, b in (parse_problem(r["problem"]) for r in read_rows(SHIPPED / f"{split}.jsonl"))
        }

    assert keys("train").isdisjoint(keys("validation"))
    assert sum(p.stat().st_size for p in SHIPPED.glob("*.jsonl")) < 1_000_000
