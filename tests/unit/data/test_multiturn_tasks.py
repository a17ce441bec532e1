"""The multi-turn prompt sets: generators are deterministic with disjoint splits, and the shipped JSONL
files are exactly what the build script writes; the data pipeline reads them by name."""

from __future__ import annotations

import json
from pathlib import Path

from nemo_like.config.schema import MasterConfig
from nemo_like.data.datasets import load_problems
from nemo_like.data.multiturn_tasks import ASSET_DIR, make_guess_number_problems, make_multiply_problems, multiply_split
from nemo_like.data.templates import PromptFormat
from nemo_like.utils.imports import import_object

BUILDER = str(Path(__file__).resolve().parents[3] / "scripts" / "build_multiturn_datasets.py")


def test_multiply_rows_are_right_deterministic_and_split_by_operands() -> None:
    rows = make_multiply_problems(300, 5, "train")
    assert rows == make_multiply_problems(300, 5, "train") and rows[:10] == make_multiply_problems(10, 5, "train")
    for row in rows:
        a, b = (int(t) for t in row["problem"].replace("?", " ").replace(".", " ").split() if t.isdigit())
        assert 100 <= a <= 999 and 10 <= b <= 99 and row["answer"] == str(a * b) and multiply_split(a, b) == "train"
    val = {r["problem"] for r in make_multiply_problems(300, 5, "validation")}
    assert not val & {r["problem"] for r in rows}
    secrets = [int(r["answer"]) for r in make_guess_number_problems(500, 0, 1, 100)]
    assert min(secrets) == 1 and max(secrets) == 100


def test_shipped_files_match_the_builder_and_load_by_name(tmp_path) -> None:
    import_object(f"{BUILDER}:main")(["--out", str(tmp_path)])
    for name in ("tool-arith", "guess-number"):
        for split in import_object(f"{BUILDER}:SIZES"):
            assert (tmp_path / name / f"{split}.jsonl").read_bytes() == (ASSET_DIR / name / f"{split}.jsonl").read_bytes()
    cfg = MasterConfig.model_validate({"data": {"dataset_name": "tool-arith", "train": {"num_problems": 5}}}).data
    problems = load_problems(cfg, "train", PromptFormat())
    assert len(problems) == 5 and {p.task_name for p in problems} == {"tool"}
    shipped = [json.loads(line) for line in (ASSET_DIR / "tool-arith" / "train.jsonl").read_text().splitlines()]
    by_prompt = {row["problem"]: row["answer"] for row in shipped}
    assert all(by_prompt[p.messages[0]["content"]] == p.answer for p in problems)
