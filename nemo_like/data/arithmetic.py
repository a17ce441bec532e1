"""Seeded generator of small arithmetic word problems with checked integer answers.

This is the default task of the project's end-to-end demo (see ``docs/guides/tiny-model.md``).
A problem is one operation on two small non-negative integers, phrased with one of a few word
templates, e.g. ``"What is 12 plus 7?"``; the expected assistant response is just the integer
(``"19"``) followed by the end-of-turn token.

Train/validation split
    Every operand tuple ``(op, a, b)`` belongs to exactly one split, decided by a hash of its
    canonical form (for the commutative ``+`` the operands are sorted first, so ``3 + 5`` and
    ``5 + 3`` land in the same split). The split does not depend on ``n``, ``seed`` or the word
    template, so no validation problem ever appears in a training set.

Sampling
    ``make_arithmetic_problems`` draws distinct operand tuples of the requested split (a seeded
    shuffle of the split's pool); only when ``n`` exceeds the pool size does it start another
    shuffled pass, so tuples repeat only then. The word template is drawn per problem.
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass
from typing import Literal

Split = Literal["train", "validation"]
Op = Literal["+", "-"]

#: Operands are drawn from ``0..MAX_OPERAND`` (inclusive). Subtraction keeps ``a >= b``.
MAX_OPERAND = 99
#: Supported operations.
OPS: tuple[Op, ...] = ("+", "-")
#: Percentage of operand tuples that belong to the validation split.
VALIDATION_PERCENT = 20

#: Word templates per operation; ``{a}`` and ``{b}`` are the operands of ``a op b``.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "What is {a} plus {b}?",
        "What is {a} + {b}?",
        "Compute {a} + {b}.",
        "What is the sum of {a} and {b}?",
        "Add {a} and {b}.",
    ),
    "-": (
        "What is {a} minus {b}?",
        "What is {a} - {b}?",
        "Compute {a} - {b}.",
        "What is the difference between {a} and {b}?",
        "Subtract {b} from {a}.",
    ),
}

#: Optional system prompt for :func:`format_messages` (the shipped model is trained without one).
DEFAULT_SYSTEM_PROMPT = "Answer with a single integer."


@dataclass(frozen=True)
class ArithmeticProblem:
    """One arithmetic word problem.

    Attributes:
        prompt: the user message text, e.g. ``"What is 12 plus 7?"``.
        answer: the correct integer answer (``a op b``).
        id: unique within one :func:`make_arithmetic_problems` call:
            ``"{split}-{seed}-{index}"``.
        op: the operation, ``"+"`` or ``"-"``.
        a: the first operand.
        b: the second operand.
    """

    prompt: str
    answer: int
    id: str
    op: str = "+"
    a: int = 0
    b: int = 0


def compute_answer(op: str, a: int, b: int) -> int:
    """Return ``a op b`` for a supported ``op`` (``"+"`` or ``"-"``)."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    raise ValueError(f"unsupported op {op!r}; expected one of {OPS}")


def split_of(op: str, a: int, b: int) -> Split:
    """The split that the operand tuple ``(op, a, b)`` belongs to (hash-based, seed-independent)."""
    x, y = (min(a, b), max(a, b)) if op == "+" else (a, b)
    digest = hashlib.sha256(f"{op}|{x}|{y}".encode()).digest()
    bucket = int.from_bytes(digest[:8], "big") % 100
    return "validation" if bucket < VALIDATION_PERCENT else "train"


@functools.lru_cache(maxsize=8)
def _pool(split: Split, max_operand: int, ops: tuple[str, ...]) -> tuple[tuple[str, int, int], ...]:
    """All operand tuples of ``split`` in a fixed order (subtraction only with ``a >= b``)."""
    tuples = []
    for op in ops:
        if op not in TEMPLATES:
            raise ValueError(f"unsupported op {op!r}; expected one of {OPS}")
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                if op == "-" and b > a:
                    continue
                if split_of(op, a, b) == split:
                    tuples.append((op, a, b))
    return tuple(tuples)


def make_arithmetic_problems(
    n: int,
    seed: int,
    split: Split,
    *,
    max_operand: int = MAX_OPERAND,
    ops: tuple[str, ...] = OPS,
) -> list[ArithmeticProblem]:
    """Generate ``n`` problems of ``split``, deterministically for a given ``seed``.

    Args:
        n: number of problems (>= 0).
        seed: RNG seed; the same arguments always give the same list.
        split: ``"train"`` or ``"validation"``; the two never share an operand tuple.
        max_operand: operands are drawn from ``0..max_operand``.
        ops: operations to draw from.

    Returns:
        ``n`` problems; operand tuples are distinct unless ``n`` exceeds the split's pool size.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pool = _pool(split, max_operand, tuple(ops))
    if n and not pool:
        raise ValueError(f"no {split} problems for max_operand={max_operand}, ops={ops}")
    rng = random.Random(f"arithmetic/{split}/{seed}")
    problems: list[ArithmeticProblem] = []
    while len(problems) < n:
        order = list(pool)
        rng.shuffle(order)
        for op, a, b in order[: n - len(problems)]:
            template = rng.choice(TEMPLATES[op])
            problems.append(
                ArithmeticProblem(
                    prompt=template.format(a=a, b=b),
                    answer=compute_answer(op, a, b),
                    id=f"{split}-{seed}-{len(problems)}",
                    op=op,
                    a=a,
                    b=b,
                )
            )
    return problems


def format_messages(problem: ArithmeticProblem, system_prompt: str | None = None) -> list[dict[str, str]]:
    """Chat messages for ``problem``: an optional system turn, then the user turn.

    The shipped tiny model was trained without a system prompt, so keep the default ``None``
    for it; pass e.g. :data:`DEFAULT_SYSTEM_PROMPT` for other models.
    """
    messages: list[dict[str, str]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": problem.prompt})
    return messages


def format_response(problem: ArithmeticProblem) -> str:
    """The reference assistant response text: just the integer answer, e.g. ``"19"``."""
    return str(problem.answer)
