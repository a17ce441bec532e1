"""Exact-match reward for the arithmetic task (:mod:`nemo_like.data.arithmetic`).

Parsing rule (exactly): the response text is stripped of surrounding whitespace; then any
trailing end-of-turn / padding marker strings (``<|im_end|>``, ``<|endoftext|>``, in case the
text was decoded with special tokens kept) are removed, stripping whitespace again after each;
what remains must be one ASCII integer literal matching ``[+-]?[0-9]+`` in full (leading zeros
allowed: ``"007"`` is 7). Anything else (extra words, a second number, ``"19."``, ``"1 9"``,
an empty response) does not parse. The reward is 1.0 when the parsed integer equals the answer,
else 0.0.
"""

from __future__ import annotations

import re
from typing import Any

_INTEGER = re.compile(r"[+-]?[0-9]+")
#: Marker strings removed from the end of a response before parsing.
END_MARKERS: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")


def _strip_end_markers(text: str) -> str:
    """Strip whitespace and any trailing :data:`END_MARKERS` (repeatedly)."""
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for marker in END_MARKERS:
            if text.endswith(marker):
                text = text[: -len(marker)].strip()
                changed = True
    return text


def extract_integer(text: str) -> int | None:
    """Parse ``text`` as a single integer (see the module docstring), or ``None`` if it is not one."""
    stripped = _strip_end_markers(text)
    if not _INTEGER.fullmatch(stripped):
        return None
    try:
        return int(stripped)
    except ValueError:  # more digits than Python converts (4300): no answer of ours is that long
        return None


def integer_answer(answer: Any) -> int | None:
    """A gold answer as an integer: an int, or a string holding one (dataset rows carry answers as text, e.g.
    ``"19"``); ``None`` when it is neither."""
    if isinstance(answer, int) and not isinstance(answer, bool):
        return answer
    return extract_integer(str(answer))


def not_an_integer(answer: Any, what: str) -> str | None:
    """:meth:`EnvironmentInterface.answer_problem` of the environments that compare integers (``what`` says which
    comparison): ``None`` when ``answer`` is one."""
    return None if integer_answer(answer) is not None else f"{answer!r} is not an integer ({what})"


def score_response(response_text: str, answer: int | str) -> float:
    """1.0 if ``response_text`` parses (see :func:`extract_integer`) to exactly ``answer``, else 0.0.
    ``answer``: see :func:`integer_answer`."""
    value = extract_integer(response_text)
    expected = integer_answer(answer)
    return 1.0 if value is not None and expected is not None and value == expected else 0.0
