"""Prompt datasets (tokenised through the chat template) and a resumable, seeded data loader."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import DataConfig


class DataExhausted(RuntimeError):
    """The training prompts ran out (``grpo.max_num_epochs`` reached): no further step gets a batch."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt ready for generation, with what the environment needs to score it."""

    id: str
    messages: list[dict[str, str]]
    prompt_token_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)


def build_prompt_dataset(data: DataConfig, tokenizer, split: str, max_prompt_tokens: int) -> list[PromptRecord]:
    """Generate the ``split`` prompts of ``data.dataset_name`` and tokenise them."""
    from nemo_like.data.arithmetic import format_messages, make_arithmetic_problems

    split_cfg = data.train if split == "train" else data.validation
    problems = make_arithmetic_problems(split_cfg.num_problems, seed=split_cfg.seed, split=split)
    records = []
    for problem in problems:
        messages = format_messages(problem, data.system_prompt)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "input_ids"):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        if len(ids) > max_prompt_tokens:
            raise ConfigError(
                f"Prompt {problem.id} has {len(ids)} tokens, more than policy.max_total_sequence_length - "
                f"policy.generation.max_new_tokens = {max_prompt_tokens}"
            )
        records.append(PromptRecord(problem.id, messages, list(ids), {"answer": problem.answer, "task_name": "arithmetic"}))
    return records


class PromptDataLoader:
    """Yields batches of prompts forever, epoch after epoch, reshuffled per epoch with a fixed seed.

    Its position (epoch, index) is its whole state, so a resumed run sees the same prompts.
    """

    def __init__(self, records: list[PromptRecord], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if batch_size > len(records):
            raise ConfigError(f"grpo.num_prompts_per_step ({batch_size}) exceeds the {len(records)} training prompts")
        self.records, self.batch_size, self.seed, self.shuffle = records, batch_size, seed, shuffle
        self.epoch, self.index = 0, 0
        self.consumed = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[PromptRecord]:
        """The next ``batch_size`` prompts (an incomplete tail of an epoch is skipped)."""
        if self.index + self.batch_size > len(self._order):
            self.epoch += 1
            self.index = 0
            self._order = self._epoch_order(self.epoch)
        batch = [self.records[i] for i in self._order[self.index : self.index + self.batch_size]]
        self.index += self.batch_size
        self.consumed += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index, self.consumed = state["epoch"], state["index"], state["consumed"]
        self._order = self._epoch_order(self.epoch)
