"""Tests of the exact-match arithmetic reward."""

from __future__ import annotations

import pytest

from nemo_like.environments.arithmetic_reward import extract_integer, score_response


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("19", 19),
        (" 19 ", 19),
        ("\n19\n", 19),
        ("19<|im_end|>", 19),
        ("19 <|im_end|>\n", 19),
        ("19<|im_end|><|endoftext|><|endoftext|>", 19),
        ("-3", -3),
        ("+4", 4),
        ("007", 7),
        ("0", 0),
        ("", None),
        ("   ", None),
        ("<|im_end|>", None),
        ("19.", None),
        ("19.0", None),
        ("1 9", None),
        ("19 20", None),
        ("The answer is 19", None),
        ("19 apples", None),
        ("nineteen", None),
        ("- 3", None),
        ("--3", None),
        ("١٩", None),  # non-ASCII digits do not count
        ("<|im_end|>19", None),
        ("9" * 5000, None),  # more digits than int() converts: not an answer, not a crash
    ],
)
def test_extract_integer(text: str, expected: int | None) -> None:
    assert extract_integer(text) == expected


@pytest.mark.parametrize(
    ("text", "answer", "reward"),
    [
        ("19", 19, 1.0),
        (" 19\n", 19, 1.0),
        ("19<|im_end|>", 19, 1.0),
        ("18", 19, 0.0),
        ("190", 19, 0.0),
        ("1", 19, 0.0),
        ("", 19, 0.0),
        ("19 19", 19, 0.0),
        ("-5", -5, 1.0),
        ("5", -5, 0.0),
        ("0", 0, 1.0),
        ("19", "19", 1.0),  # dataset rows carry the answer as text
        ("19", " 19 ", 1.0),
        ("18", "19", 0.0),
        ("19", "19.0", 0.0),  # not an integer literal: the arithmetic task is exact; math-verify compares values
        ("19", "nineteen", 0.0),
    ],
)
def test_score_response(text: str, answer: int | str, reward: float) -> None:
    assert score_response(text, answer) == reward


def test_score_is_float() -> None:
    assert isinstance(score_response("1", 1), float)
    assert isinstance(score_response("x", 1), float)
