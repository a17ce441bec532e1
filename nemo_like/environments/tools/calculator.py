"""The built-in ``calculator`` tool: a safe arithmetic expression evaluator.

The expression is parsed with :mod:`ast` and only these nodes are evaluated: number literals (int or
float; not bool, str, complex), unary ``+``/``-``, and binary ``+ - * / // % **``, with parentheses.
Names, calls, attributes, subscripts, comprehensions, lambdas and everything else are rejected before
anything runs, so nothing but arithmetic can execute. Sizes are bounded so no call can hang or eat memory:
the text is at most :data:`MAX_EXPRESSION_CHARS` characters, an exponent's magnitude at most
:data:`MAX_EXPONENT`, and every intermediate integer at most :data:`MAX_RESULT_DIGITS` digits (checked
*before* a power or a product is computed).

Results: ints as decimal text (an int divided exactly by an int is an int, every digit kept); floats via ``repr``,
except integral floats below 1e15, which print as ints (``10/2.0`` -> ``5``) so a model can copy them as integer answers.
"""

from __future__ import annotations

import ast
import math
import operator

from nemo_like.environments.tools.errors import ToolError

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000
MAX_RESULT_DIGITS = 1000

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ToolError):
    """The expression is not allowed, too large, or undefined (e.g. division by zero); kind ``bad_expression``."""

    def __init__(self, message: str) -> None:
        super().__init__("bad_expression", message)


def _digits(value: float) -> float:
    """Decimal digits of ``|value|`` (a float estimate; 0 for 0)."""
    return math.log10(abs(value)) + 1 if value else 0.0


_INT_LIMIT = 10**MAX_RESULT_DIGITS  # the smallest int with more than MAX_RESULT_DIGITS digits


def _check_size(value: int | float) -> int | float:
    if isinstance(value, int) and abs(value) >= _INT_LIMIT:
        raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    return value


def _not_underflowed(value: int | float, *operands: int | float) -> int | float:
    """``value`` (a product, quotient or power of ``operands``), refused where a float result of non-zero operands came
    out 0: ``10**-400`` showed as an exact ``0``, which an integer checker would take. An intermediate result is
    refused too (``1 - 0.5**600 * 0.5**600``, 1.0 in Python): the calculator reports what it cannot represent."""
    if isinstance(value, float) and value == 0 and all(operands):
        raise CalculatorError("result is too small for a float (it underflows to 0)")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} exceeds {MAX_EXPONENT} in magnitude")
    # |base| ** exponent has floor(exponent * log10|base|) + 1 digits: refuse before computing one too long.
    if (
        isinstance(base, int)
        and isinstance(exponent, int)
        and exponent > 0
        and base
        and (_digits(base) - 1) * exponent + 1 > MAX_RESULT_DIGITS + 1
    ):
        raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
    if base == 0 and exponent < 0:
        raise CalculatorError("zero to a negative power")
    try:
        result = base**exponent
    except OverflowError:  # a float power out of range (10.0 ** 400, (10 ** 400) ** -1)
        raise CalculatorError("result is too large") from None
    if isinstance(result, complex):
        raise CalculatorError("result is complex (a negative number to a fractional power)")
    return result


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _not_underflowed(_check_size(_power(left, right)), left)
        # an int product has at least bit_length(l) + bit_length(r) - 1 bits: refuse one surely too long before computing
        # it, and let _check_size decide the rest exactly (a float estimate of its digits refused 1000-digit products)
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() - 1 > _INT_LIMIT.bit_length():
                raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        if isinstance(node.op, ast.Div) and isinstance(left, int) and isinstance(right, int) and left % right == 0:
            return left // right  # exact: a float would lose digits past 2**53 (123456789012345678/2)
        try:
            value = _check_size(_BINARY[type(node.op)](left, right))
            return _not_underflowed(value, left, right) if isinstance(node.op, (ast.Mult, ast.Div)) else value
        except OverflowError:
            raise CalculatorError("result is too large") from None
    raise CalculatorError(f"{type(node).__name__} is not allowed (only numbers, parentheses and + - * / // % **)")


def evaluate_expression(expression: str) -> int | float:
    """The value of an arithmetic ``expression`` (see the module docstring for what is allowed).

    Raises:
        CalculatorError: anything not allowed, too large, or undefined."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"invalid expression: {exc.msg}") from None
    except ValueError as exc:  # a lone surrogate (UnicodeEncodeError), a null byte
        raise CalculatorError(f"invalid expression: {exc}") from None
    for node in ast.walk(tree):  # 1e-400 parses as 0.0: an exact 0 the model never wrote
        if isinstance(node, ast.Constant) and isinstance(node.value, float) and node.value == 0:
            written = ast.get_source_segment(expression.strip(), node) or ""
            if any(d in "123456789" for d in written.lower().split("e")[0]):
                raise CalculatorError(f"{written} is too small for a float (it reads as 0)")
    return _evaluate(tree)


def format_number(value: int | float) -> str:
    """Decimal text of a result (integral floats below 1e15 as ints)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


# The built-in tools' docstrings are what a prompt's tool list tells the model (tools_in_prompt: schemas.tool_schema).
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression to evaluate, e.g. 347*28
    """
    return format_number(evaluate_expression(expression))
