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
    ``make_arithmetic_problems`` draws the operation uniformly per problem (balanced ``+``/``-``),
    then the next operand pair from a seeded shuffle of that operation's pool in the requested
    split (so pairs are distinct until a pool is exhausted; then another shuffled pass starts),
    then a word template.
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
        op: the operation, ``"+"`` or ``"-"`` (``None`` for a hand-made problem).
        a: the first operand of ``a op b`` (``None`` for a hand-made problem).
        b: the second operand (``None`` for a hand-made problem).
    """

    prompt: str
    answer: int
    id: str
    op: str | None = None
    a: int | None = None
    b: int | None = None


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


@functools.lru_cache(maxsize=16)
def _pool(split: Split, op: str, max_operand: int) -> tuple[tuple[int, int], ...]:
    """All operand pairs ``(a, b)`` of ``op`` in ``split``, in a fixed order (``-`` needs ``a >= b``)."""
    if op not in TEMPLATES:
        raise ValueError(f"unsupported op {op!r}; expected one of {OPS}")
    return tuple(
        (a, b) for a in range(max_operand + 1) for b in range(max_operand + 1) if not (op == "-" and b > a) and split_of(op, a, b) == split
    )


class _PairStream:
    """Endless stream of the pairs of one pool: seeded shuffled passes, distinct within a pass."""

    def __init__(self, pool: tuple[tuple[int, int], ...], rng: random.Random) -> None:
        self._pool, self._rng, self._order = pool, rng, []

    def next(self) -> tuple[int, int]:
        if not self._order:
            self._order = list(self._pool)
            self._rng.shuffle(self._order)
            self._order.reverse()  # pop() from the end == take from the front of the shuffle
        return self._order.pop()


def make_arithmetic_problems(
    n: int,
    seed: int,
    split: Split,
    *,
    max_operand: int = MAX_OPERAND,
    ops: tuple[str, ...] = OPS,
) -> list[ArithmeticProblem]:
    """Generate ``n`` problems of ``split``, deterministically for a given ``seed``.

    Each problem draws its operation uniformly from ``ops`` (so the operations are balanced),
    then the next operand pair of that operation's seeded shuffled pool, then a word template.

    Args:
        n: number of problems (>= 0).
        seed: RNG seed; the same arguments always give the same list, and a longer list starts
            with the shorter one.
        split: ``"train"`` or ``"validation"``; the two never share an operand tuple.
        max_operand: operands are drawn from ``0..max_operand``.
        ops: operations to draw from.

    Returns:
        ``n`` problems; operand tuples are distinct unless an operation's pool is exhausted.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not ops:
        raise ValueError("ops must not be empty")
    rng = random.Random(f"arithmetic/{split}/{seed}")
    streams = {}
    for op in ops:
        pool = _pool(split, op, max_operand)
        if not pool:
            raise ValueError(f"no {split} problems for op {op!r} with max_operand={max_operand}")
        streams[op] = _PairStream(pool, random.Random(f"arithmetic/{split}/{seed}/{op}"))
    problems: list[ArithmeticProblem] = []
    for index in range(n):
        op = rng.choice(ops)
        a, b = streams[op].next()
        problems.append(
            ArithmeticProblem(
                prompt=rng.choice(TEMPLATES[op]).format(a=a, b=b),
                answer=compute_answer(op, a, b),
                id=f"{split}-{seed}-{index}",
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
