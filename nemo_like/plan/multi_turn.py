"""Whether a run is multi-turn, and what the turn loop needs from the recipe: decided once in the run plan."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

#: The roles an environment's observations may take when it does not say (``EnvironmentInterface.reply_roles``).
ANY_REPLY_ROLES = ("user", "tool")


@dataclass(frozen=True)
class MultiTurnSettings:
    """What the turn loop needs from the recipe (picklable: the async trajectory collector gets it too)."""

    max_turns: int  # grpo.max_rollout_turns
    max_total_length: int  # policy.max_total_sequence_length
    eos_token_ids: tuple[int, ...]  # tokens that end a turn (eos + policy.generation.stop_token_ids)
    # The recipe's stop ids that are not the tokenizer's eos: a turn ending on one keeps it in its message's text unless
    # the chat template writes it with an assistant turn (<|im_end|> for a base tokenizer, not </tool_call>: turn_ends)
    recipe_stop_ids: tuple[int, ...] = ()
    # Per task, the roles its environment's observations take (``EnvironmentInterface.reply_roles``): where a row is
    # full, the turn loop asks whether such a reply would branch into a row with room (``ends_after_step``).
    reply_roles: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def reply_roles_of(self, task: str | None) -> tuple[str, ...]:
        """The roles the observations of ``task``'s environment take (:data:`ANY_REPLY_ROLES` when not known); a prompt
        naming no task goes to the only environment."""
        if task is None and len(self.reply_roles) == 1:
            return self.reply_roles[0][1]
        return dict(self.reply_roles).get(task, ANY_REPLY_ROLES) if task is not None else ANY_REPLY_ROLES


def with_reply_roles(settings: MultiTurnSettings | None, roles: dict[str, tuple[str, ...]]) -> MultiTurnSettings | None:
    """``settings`` with each task's reply roles (``None`` stays ``None``: a single-turn run)."""
    return None if settings is None else replace(settings, reply_roles=tuple(sorted(roles.items())))


def multi_turn_settings(cfg: Any, eos_token_ids: tuple[int, ...]) -> MultiTurnSettings | None:
    """The run's settings, or ``None`` for single-turn runs (``grpo.max_rollout_turns: 1``, today's path exactly)."""
    if cfg.grpo.max_rollout_turns <= 1:
        return None
    # Every stop token ends a turn (e.g. <|im_end|> set in stop_token_ids for a base tokenizer whose eos is <|endoftext|>).
    stops = tuple(dict.fromkeys(i for i in cfg.policy.generation.stop_token_ids or () if i not in eos_token_ids))
    return MultiTurnSettings(
        cfg.grpo.max_rollout_turns, cfg.policy.max_total_sequence_length, (*dict.fromkeys(eos_token_ids), *stops), stops
    )
