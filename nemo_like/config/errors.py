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
    """Return ``" Did you mean 'x'?"`` for the closest candidate, ``" Did you mean one of 'x', 'y'?"`` when several are
    equally likely (:func:`closest_keys`), or ``""`` when none is close."""
    close = closest_keys(name, candidates)
    if not close:
        return ""
    if len(close) == 1:
        return f" Did you mean '{close[0]}'?"
    return f" Did you mean one of {', '.join(repr(c) for c in close)}?"


#: At most this many equally likely keys of other sections are listed.
MAX_SUGGESTIONS = 4


def closest_keys(name: str, candidates: Iterable[str]) -> list[str]:
    """The candidates ``name`` most likely meant: one, several equally likely, or none (``[]``).

    Keys of the same section come first, compared by their last dotted part (compared whole, every key of a section
    shares its prefix, and ``policy.optimizer.learning_rate`` suggested ``policy.optimizer.name``), a peer's name for
    one of them (:data:`ALIASES`) before a close spelling. Then a key put in the wrong section: the keys of other
    sections with the same last part (or its alias, or a nearly equal spelling), ranked by how much of the rest of the
    path they share (:func:`_path_overlap`: ``grpo.lora.enabled`` means ``policy.lora_cfg.enabled``); keys that tie are
    all listed (``model_name`` is ``policy.model_name`` or ``teacher.model_name``: naming only the last section's had a
    user switch on distillation by following the hint)."""
    candidates = list(candidates)
    parent, _, leaf = name.rpartition(".")
    siblings = {c.rpartition(".")[2]: c for c in candidates if c.rpartition(".")[0] == parent}
    elsewhere: dict[str, list[str]] = {}
    for c in candidates:
        if c.rpartition(".")[0] != parent:
            elsewhere.setdefault(c.rpartition(".")[2], []).append(c)
    alias = ALIASES.get(leaf)
    if alias in siblings:
        return [siblings[alias]]
    close = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)
    if close:
        return [siblings[close[0]]]
    if alias in elsewhere:
        keys = elsewhere[alias]
    else:
        close = difflib.get_close_matches(leaf, list(elsewhere), n=1, cutoff=0.8)
        keys = elsewhere[close[0]] if close else []
    if not keys:
        return []
    parts = parent.split(".") if parent else []
    scores = {key: _path_overlap(parts, key.rpartition(".")[0].split(".")) for key in keys}
    best = max(scores.values())
    tied = sorted((key for key, score in scores.items() if score == best), key=lambda k: (k.count("."), k))
    return tied[:MAX_SUGGESTIONS]


def _path_overlap(typed: list[str], candidate: list[str]) -> float:
    """How much of the typed section path ``typed`` a candidate's section path holds: per typed part, its best spelling
    match among the candidate's parts (0 below 0.6), later parts weighing more (the part before the leaf names the
    subsection, the first only the top section)."""
    total = 0.0
    for weight, part in enumerate(typed, start=1):
        match = max((difflib.SequenceMatcher(None, part, other).ratio() for other in candidate), default=0.0)
        total += weight * match if match >= 0.6 else 0.0
    return total
