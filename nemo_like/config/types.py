"""Field types that refuse values pydantic would silently accept.

pydantic's lax mode turns ``true`` into ``1.0`` for a float key and ``1`` for an int key, so a
recipe line like ``reference_policy_kl_penalty: true`` would silently mean a KL weight of 1. Every
numeric key of the schema uses :data:`Float` or :data:`Int` instead: a boolean is an error naming
the key and the expected type; an int stays valid where a float is expected (``lr: 1``). A float
key must also be finite: ``nan`` passes every ``<=``/``>=`` check (``rollout_rejection``'s
``upper: nan`` kept every token) and no key of the schema means anything by ``inf``.

:data:`OptStr` is a text key that may be null: YAML and overrides spell null ``null`` (or ``~``),
so ``None`` would reach the run as the text "None" (a system prompt of "None"); it is an error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AllowInfNan, BeforeValidator, PlainValidator
from pydantic_core import PydanticCustomError


def _reject_bool(expected: str) -> BeforeValidator:
    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise PydanticCustomError(
                "bool_for_number",
                "expected {expected}, not a boolean",
                {"expected": expected},
            )
        return value

    return BeforeValidator(check)


Float = Annotated[float, AllowInfNan(False), _reject_bool("a number")]
Int = Annotated[int, _reject_bool("an integer")]


def _none_as_text(value: Any) -> Any:
    if isinstance(value, str) and value.strip() in ("None", "none", "NONE"):
        raise PydanticCustomError("none_text", "write null (or ~) for no value; None here would be the text 'None'")
    return value


OptStr = Annotated[str | None, BeforeValidator(_none_as_text)]


def _thread_count(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("bool_for_number", "expected an integer, not a boolean")
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise PydanticCustomError("thread_count", "expected a positive integer or 'auto'")


# A thread count: a positive integer, or "auto" for the automatic split (nemo_like/distributed/threads.py).
ThreadCount = Annotated[int | Literal["auto"], PlainValidator(_thread_count)]
