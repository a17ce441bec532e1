"""Whether a run is multi-turn, and what the turn loop needs from the recipe: decided once in the run plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MultiTurnSettings:
    """What the turn loop needs from the recipe (picklable: the async trajectory collector gets it too)."""

    max_turns: int  # grpo.max_rollout_turns
    max_total_length: int  # policy.max_total_sequence_length
    eos_token_ids: tuple[int, ...]  # tokens that end a turn (eos + policy.generation.stop_token_ids)
    # The recipe's stop ids that are not the tokenizer's eos: a turn ending on one keeps it in its message's text unless
    # the chat template writes it with an assistant turn (<|im_end|> for a base tokenizer, not </tool_call>: turn_ends)
    recipe_stop_ids: tuple[int, ...] = ()


def multi_turn_settings(cfg: Any, eos_token_ids: tuple[int, ...]) -> MultiTurnSettings | None:
    """The run's settings, or ``None`` for single-turn runs (``grpo.max_rollout_turns: 1``, today's path exactly)."""
    if cfg.grpo.max_rollout_turns <= 1:
        return None
    # Every stop token ends a turn (e.g. <|im_end|> set in stop_token_ids for a base tokenizer whose eos is <|endoftext|>).
    stops = tuple(dict.fromkeys(i for i in cfg.policy.generation.stop_token_ids or () if i not in eos_token_ids))
    return MultiTurnSettings(
        cfg.grpo.max_rollout_turns, cfg.policy.max_total_sequence_length, (*dict.fromkeys(eos_token_ids), *stops), stops
    )
