"""Whether a run is multi-turn, and what the turn loop needs from the recipe: decided once in the run plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MultiTurnSettings:
    """What the turn loop needs from the recipe (picklable: the async trajectory collector gets it too)."""

    max_turns: int  # grpo.max_rollout_turns
    max_total_length: int  # policy.max_total_sequence_length
    eos_token_ids: tuple[int, ...]  # end-of-turn tokens (eos + policy.generation.stop_token_ids): not part of a message's text


def multi_turn_settings(cfg: Any, eos_token_ids: tuple[int, ...]) -> MultiTurnSettings | None:
    """The run's settings, or ``None`` for single-turn runs (``grpo.max_rollout_turns: 1``, today's path exactly)."""
    if cfg.grpo.max_rollout_turns <= 1:
        return None
    # Every stop token ends a turn (e.g. <|im_end|> set in stop_token_ids for a base tokenizer whose eos is <|endoftext|>).
    end_of_turn = tuple(dict.fromkeys([*eos_token_ids, *(cfg.policy.generation.stop_token_ids or ())]))
    return MultiTurnSettings(cfg.grpo.max_rollout_turns, cfg.policy.max_total_sequence_length, end_of_turn)
