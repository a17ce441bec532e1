"""User-facing configuration errors: one exception type the CLI prints without a traceback."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A recipe, override or value that the user must fix. The message says what and where."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest candidate, or ``""`` when none is close."""
    candidates = list(candidates)
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    if not close:
        # Compare the last dotted component too: 'grpo.num_prompt_per_step' vs 'num_prompts_per_step'.
        leaf = name.rsplit(".", 1)[-1]
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
        leaf_close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        close = [by_leaf[leaf_close[0]]] if leaf_close else []
    return f" Did you mean '{close[0]}'?" if close else ""
