"""The base of every config section, and helpers several sections share."""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

EMBEDDED_MODEL = "embedded:tiny-arith-qwen2"


class Section(BaseModel):
    """Base for config sections: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


def changed_from_defaults(settings: BaseModel, keys: Iterable[str] | None = None) -> list[str]:
    """Those of ``keys`` (default: every field) whose value in ``settings`` differs from the field's default, in field
    order: what a "has no effect" warning names. Not ``model_fields_set``: settings validated again from their full dump
    (an environment's, in its actors) mark every default as set."""
    fields = type(settings).model_fields
    names = fields if keys is None else keys
    return [k for k in names if getattr(settings, k) != fields[k].get_default(call_default_factory=True)]


def set_while_off(settings: BaseModel, switch: str = "enabled", exclude: Iterable[str] = ()) -> list[str]:
    """The keys of ``settings`` changed from their defaults (:func:`changed_from_defaults`) while its ``switch`` is
    off, which therefore do nothing (the switch itself and ``exclude`` aside); none while it is on."""
    if getattr(settings, switch):
        return []
    return [k for k in changed_from_defaults(settings) if k != switch and k not in exclude]


def default_pass_k(n: int) -> list[int]:
    """The ks reported when none are given, for ``n`` samples per prompt: 1, 2, 4, ... up to ``n``, and ``n``
    itself when it is not a power of two (``n = 1``: [1]; ``n = 6``: [1, 2, 4, 6]; ``n = 8``: [1, 2, 4, 8])."""
    if n < 1:
        raise ValueError(f"pass@k needs at least one sample per prompt, got n={n}")
    ks = [1 << i for i in range(n.bit_length())]
    return ks if ks[-1] == n else [*ks, n]


def check_pass_k(ks: list[int], n: int, key: str, n_key: str) -> None:
    """Every k in 1..n, no duplicates (pass@k needs at least k samples per prompt)."""
    if not ks:
        raise ValueError(f"{key} must list at least one k")
    if len(set(ks)) != len(ks):
        raise ValueError(f"{key} has duplicates: {ks}")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"{key}: k must be between 1 and {n_key} = {n} (pass@k needs k samples per prompt), got {bad}")
