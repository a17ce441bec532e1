"""Tests of the seeded arithmetic problem generator."""

from __future__ import annotations

import dataclasses
import re

import pytest

from nemo_like.data.arithmetic import (
    MAX_OPERAND,
    TEMPLATES,
    ArithmeticProblem,
    compute_answer,
    format_messages,
    format_response,
    make_arithmetic_problems,
    split_of,
)


def _key(p: ArithmeticProblem) -> tuple[str, int, int]:
    """Canonical operand tuple (``+`` is commutative)."""
    return (p.op, min(p.a, p.b), max(p.a, p.b)) if p.op == "+" else (p.op, p.a, p.b)


def test_same_seed_same_problems() -> None:
    assert make_arithmetic_problems(500, 3, "train") == make_arithmetic_problems(500, 3, "train")
    assert make_arithmetic_problems(300, 3, "validation") == make_arithmetic_problems(300, 3, "validation")


def test_different_seeds_differ() -> None:
    a = [p.prompt for p in make_arithmetic_problems(200, 0, "train")]
    b = [p.prompt for p in make_arithmetic_problems(200, 1, "train")]
    assert a != b


def test_prefix_stable_in_n() -> None:
    """Asking for more problems extends the list; it does not reshuffle the first ones."""
    short = make_arithmetic_problems(50, 5, "validation")
    long = make_arithmetic_problems(400, 5, "validation")
    assert long[:50] == short


def test_train_validation_disjoint() -> None:
    train = {_key(p) for seed in range(3) for p in make_arithmetic_problems(5000, seed, "train")}
    val = {_key(p) for seed in range(3) for p in make_arithmetic_problems(2000, seed, "validation")}
    assert len(val) > 1000 and len(train) > 5000
    assert train.isdisjoint(val)
    assert {p.prompt for p in make_arithmetic_problems(3000, 0, "train")}.isdisjoint(
        p.prompt for p in make_arithmetic_problems(3000, 0, "validation")
    )


def test_split_of_is_commutative_for_plus() -> None:
    for a in range(0, MAX_OPERAND + 1, 7):
        for b in range(0, MAX_OPERAND + 1, 5):
            assert split_of("+", a, b) == split_of("+", b, a)


def test_split_of_matches_generated_split() -> None:
    for split in ("train", "validation"):
        for p in make_arithmetic_problems(1000, 0, split):
            assert split_of(p.op, p.a, p.b) == split


def test_validation_fraction_reasonable() -> None:
    tuples = [(op, a, b) for op in "+-" for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1) if op == "+" or b <= a]
    frac = sum(split_of(*t) == "validation" for t in tuples) / len(tuples)
    assert 0.15 < frac < 0.25


def test_answers_correct_and_prompts_consistent() -> None:
    number = re.compile(r"\d+")
    for split in ("train", "validation"):
        for p in make_arithmetic_problems(2000, 11, split):
            expected = p.a + p.b if p.op == "+" else p.a - p.b
            assert p.answer == expected == compute_answer(p.op, p.a, p.b)
            assert 0 <= p.a <= MAX_OPERAND and 0 <= p.b <= MAX_OPERAND
            assert p.answer >= 0
            assert p.prompt in {t.format(a=p.a, b=p.b) for t in TEMPLATES[p.op]}
            assert sorted(map(int, number.findall(p.prompt))) == sorted([p.a, p.b])


def test_distinct_tuples_and_unique_ids() -> None:
    problems = make_arithmetic_problems(1500, 2, "validation")
    assert len({(p.op, p.a, p.b) for p in problems}) == len(problems)
    assert len({p.id for p in problems}) == len(problems)
    assert all(p.id.startswith("validation-2-") for p in problems)


def test_more_than_pool_repeats_but_stays_in_split() -> None:
    problems = make_arithmetic_problems(20000, 0, "validation")
    assert len(problems) == 20000
    assert all(split_of(p.op, p.a, p.b) == "validation" for p in problems[::97])


def test_both_ops_and_all_templates_used() -> None:
    used = set()
    for p in make_arithmetic_problems(2000, 0, "train"):
        used.update((p.op, t) for t in TEMPLATES[p.op] if t.format(a=p.a, b=p.b) == p.prompt)
    assert used == {(op, t) for op, templates in TEMPLATES.items() for t in templates}


def test_problem_is_frozen() -> None:
    p = make_arithmetic_problems(1, 0, "train")[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.answer = 3  # type: ignore[misc]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="split must be 'train' or 'validation', got 'test'"):
        make_arithmetic_problems(3, 0, "test")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be >= 0, got -1"):
        make_arithmetic_problems(-1, 0, "train")
    with pytest.raises(ValueError, match="unsupported op '/'"):
        compute_answer("/", 1, 2)
    assert make_arithmetic_problems(0, 0, "train") == []


def test_format_messages_and_response() -> None:
    p = ArithmeticProblem(prompt="What is 12 plus 7?", answer=19, id="x", op="+", a=12, b=7)
    assert format_messages(p) == [{"role": "user", "content": "What is 12 plus 7?"}]
    with_system = format_messages(p, system_prompt="Be brief.")
    assert with_system[0] == {"role": "system", "content": "Be brief."}
    assert with_system[1]["role"] == "user"
    assert format_response(p) == "19"
