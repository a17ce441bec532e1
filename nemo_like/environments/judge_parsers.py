"""Judge output parsers: the judge model's text -> a score (a float), or :class:`JudgeParseError`.

A parser is a function ``parse(text, **options) -> float`` registered in :data:`JUDGE_PARSERS` (built-ins
``number``, ``regex``, ``json_field``) or named by import path (``my_pkg.judges:parse``); ``env.<task>.parser_options``
are its keyword arguments, checked against its signature at start-up. Any exception it raises counts as a parse
failure (the sample gets ``parse_failure_reward``), never as a crash.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Callable
from typing import Any

from nemo_like.utils.registry import Registry

Parser = Callable[..., float]
# A sign counts only where it cannot be a hyphen: not after a letter, digit or point ("GPT-4" is 4, "7-8" is 7 and 8).
_NUMBER = re.compile(r"(?:(?<![\w.])[-+])?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


class JudgeParseError(ValueError):
    """The judge's text holds no score the parser can read."""


def _finite(value: float, text: str) -> float:
    if not math.isfinite(value):
        raise JudgeParseError(f"the score in {text[:60]!r} is not finite")
    return value


def parse_number(text: str, which: str = "first") -> float:
    """The ``first`` (or ``last``) number in the text."""
    if which not in ("first", "last"):
        raise ValueError(f"which must be 'first' or 'last', got {which!r}")
    numbers = _NUMBER.findall(text)
    if not numbers:
        raise JudgeParseError(f"no number in {text[:60]!r}")
    return _finite(float(numbers[0 if which == "first" else -1]), text)


def parse_regex(text: str, pattern: str, group: int | str = 1) -> float:
    """``group`` of the first match of ``pattern`` (``re.search``), as a number."""
    match = re.search(pattern, text)
    if match is None:
        raise JudgeParseError(f"{pattern!r} does not match {text[:60]!r}")
    try:
        return _finite(float(match.group(group)), text)
    except (TypeError, ValueError):
        raise JudgeParseError(f"group {group!r} of {pattern!r} is not a number in {text[:60]!r}") from None


def parse_json_field(text: str, field: str) -> float:
    """The number at dotted path ``field`` (``a.b``) of the first JSON object in the text (booleans: 1/0)."""
    value: Any = _first_json_object(text)
    for key in field.split("."):
        if not isinstance(value, dict) or key not in value:
            raise JudgeParseError(f"no field {field!r} in the judge's JSON")
        value = value[key]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        if isinstance(value, bool):
            return float(value)
        raise JudgeParseError(f"field {field!r} is a {type(value).__name__}, not a number")
    try:
        return _finite(float(value), text)
    except ValueError:
        raise JudgeParseError(f"field {field!r} = {value!r} is not a number") from None


def _first_json_object(text: str) -> Any:
    """The first ``{`` of ``text`` that opens a JSON object, decoded (braces in the judge's reasoning, e.g. LaTeX's
    ``\\frac{1}{2}``, come before it)."""
    decoder, start, error = json.JSONDecoder(), text.find("{"), "no JSON object"
    while start >= 0:
        try:
            value = decoder.raw_decode(text, start)[0]
        except json.JSONDecodeError as exc:
            error = f"invalid JSON: {exc.msg}"
        else:
            if isinstance(value, dict):
                return value
        start = text.find("{", start + 1)
    raise JudgeParseError(f"{error} in {text[:60]!r}")


#: Judge parsers by name (``env.<task>.parser``); user code by ``'module:function'``.
JUDGE_PARSERS: Registry[Parser] = Registry("judge parser", "env.<task>.parser")
JUDGE_PARSERS.add("number", parse_number)
JUDGE_PARSERS.add("regex", parse_regex)
JUDGE_PARSERS.add("json_field", parse_json_field)


def resolve_parser(name: str, options: dict[str, Any], key: str = "parser") -> Parser:
    """The parser ``name`` with its ``options`` checked against its signature (``ValueError`` naming the key)."""
    parser = JUDGE_PARSERS.get(name, key)
    try:
        inspect.signature(parser).bind("", **options)
    except TypeError as exc:
        raise ValueError(f"parser_options {options} do not fit parser {name!r}: {exc}") from None
    if name == "number" and options.get("which", "first") not in ("first", "last"):
        raise ValueError(f"parser_options.which must be 'first' or 'last', got {options['which']!r}")
    if name == "json_field":
        field = options.get("field")
        if not isinstance(field, str) or not all(field.split(".")):
            raise ValueError(f"parser_options.field must be a dotted path of keys ('score', 'verdict.score'), got {field!r}")
    if name == "regex":
        try:
            compiled = re.compile(options.get("pattern", ""))
        except re.error as exc:
            raise ValueError(f"parser_options.pattern is not a regular expression: {exc}") from None
        group = options.get("group", 1)
        named = isinstance(group, str) and group in compiled.groupindex
        if not named and not (isinstance(group, int) and 0 <= group <= compiled.groups):
            raise ValueError(
                f"parser_options.group {group!r} is not a group of parser_options.pattern {compiled.pattern!r} (it has "
                f"{compiled.groups} numbered group(s){', named ' + str(sorted(compiled.groupindex)) if compiled.groupindex else ''}); "
                "the verdict is read from that group"
            )
    return parser
