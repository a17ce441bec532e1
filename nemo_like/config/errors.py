"""User-facing configuration errors: one exception type the CLI prints without a traceback."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A recipe, override or value that the user must fix. The message says what and where."""


#: Names other trainers (TRL, verl, OpenRLHF) give our keys: a leaf typed with one of them suggests ours.
ALIASES = {
    "learning_rate": "lr",
    "temp": "temperature",
    "group_size": "num_generations_per_prompt",
    "num_generations": "num_generations_per_prompt",
    "max_tokens": "max_new_tokens",
    "max_steps": "max_num_steps",
    "num_epochs": "max_num_epochs",
    "kl_coef": "reference_policy_kl_penalty",
}


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest candidate (:func:`closest_key`), or ``""`` when none is close."""
    close = closest_key(name, candidates)
    return f" Did you mean '{close}'?" if close else ""


def closest_key(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate ``name`` most likely meant, or ``None`` when none is close.

    Keys of the same section come first, compared by their last dotted part (compared whole, every key of a section
    shares its prefix, and ``policy.optimizer.learning_rate`` suggested ``policy.optimizer.name``), a peer's name for
    one of them (:data:`ALIASES`) before a close spelling; then the same or a nearly equal last part in another section
    (a key put in the wrong section)."""
    candidates = list(candidates)
    parent, _, leaf = name.rpartition(".")
    siblings = {c.rpartition(".")[2]: c for c in candidates if c.rpartition(".")[0] == parent}
    elsewhere = {c.rpartition(".")[2]: c for c in candidates if c.rpartition(".")[0] != parent}
    alias = ALIASES.get(leaf)
    if alias in siblings:
        return siblings[alias]
    close = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)
    if close:
        return siblings[close[0]]
    if alias in elsewhere:
        return elsewhere[alias]
    close = difflib.get_close_matches(leaf, list(elsewhere), n=1, cutoff=0.8)
    return elsewhere[close[0]] if close else None
