"""Prompt datasets (tokenised through the chat template) and a resumable, seeded data loader."""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import DataConfig
from nemo_like.models.loading import render_chat

#: A prompt's tool schemas by its task (``metadata["task_name"]``, None where the data names none), or None for none.
ToolsOf = Callable[[str | None], list[dict[str, Any]] | None]


class DataExhausted(RuntimeError):
    """The training prompts ran out (``grpo.max_num_epochs`` reached): no further step gets a batch."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt ready for generation, with what the environment needs to score it.

    ``metadata["answer"]`` is the gold answer (an int for the arithmetic task, the dataset's string
    for datasets, e.g. ``"\\frac{1}{2}"``) and ``metadata["task_name"]`` the task that routes the
    prompt to an environment ("arithmetic", or the row's task column / the set's default, e.g. "math").
    """

    id: str
    messages: list[dict[str, str]]
    prompt_token_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)
    #: The tool schemas the chat template rendered with ``messages`` (its environment's ``prompt_tools``): every later
    #: rendering of the conversation (multi-turn observations) passes them again.
    tools: list[dict[str, Any]] | None = None


def last_user_message(messages: list[dict[str, str]]) -> str:
    """The text of the last user message (what a reward model or a judge reads as the prompt); ``""`` without one."""
    return next((m.get("content", "") for m in reversed(messages) if m.get("role") == "user"), "")


#: A prompt count whose loading and tokenising the run announces (``data.<split>: rendering and tokenising N prompts``).
LARGE_SET = 10_000


def build_prompt_dataset(
    data: DataConfig, tokenizer, split: str, max_prompt_tokens: int, tools_of: ToolsOf | None = None
) -> list[PromptRecord]:
    """The ``split`` prompts of ``data``, rendered by the tokenizer's chat template and tokenised; a prompt whose task
    ``tools_of`` gives tool schemas is rendered with them (``apply_chat_template(..., tools=...)``).

    Every record's metadata carries ``answer`` (int for arithmetic, the gold string for datasets)
    and ``task_name`` (which environment scores it), and ``prompt`` (the last user message, for learned rewards). Raises ConfigError for any bad input, naming
    the file/row and the key to change; a prompt longer than ``max_prompt_tokens`` is an error
    unless ``data.drop_long_prompts``.
    """
    from nemo_like.data.datasets import is_arithmetic, load_problems
    from nemo_like.data.templates import prompt_format

    check_chat_template(tokenizer)
    fmt = prompt_format(data)
    problems = _arithmetic_problems(data, split, fmt) if is_arithmetic(data, split) else load_problems(data, split, fmt)
    refuse_special_token_texts(tokenizer, problems, split, data.prompt_key)
    if len(problems) >= LARGE_SET:  # seconds per 10,000 on 2 cores: said, so a long start is not taken for a hang
        print(f"data.{split}: rendering and tokenising {len(problems):,} prompts", flush=True)
    records, dropped = [], []
    conversations = [p.messages for p in problems]
    tools = [tools_of(p.task_name) if tools_of is not None else None for p in problems]
    try:
        tokenized = tokenize_conversations(tokenizer, conversations, tools)
    except TemplateRefused as refused:
        problem = problems[refused.index]
        message, hint = _refusal_cause(tokenizer, problem.messages, fmt.system_prompt, refused.message, data.prompt_key)
        raise ConfigError(
            f"The chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'!r} (policy.tokenizer_name, or "
            f"policy.model_name) refuses the prompt of {problem.where} (data.{split}): {message}; {hint}, or use a "
            "tokenizer whose template takes these messages"
        ) from None
    for problem, ids, prompt_tools in zip(problems, tokenized, tools):
        if len(ids) > max_prompt_tokens:
            if data.drop_long_prompts:
                dropped.append(problem.where)
                continue
            listed = f" (with the tool list its template renders: env.{problem.task_name}.tools_in_prompt)" if prompt_tools else ""
            raise ConfigError(
                f"The prompt of {problem.where} (data.{split}) has {len(ids)} tokens{listed}, more than "
                "policy.max_total_sequence_length "
                f"- policy.generation.max_new_tokens = {max_prompt_tokens}. Raise policy.max_total_sequence_length, or set "
                "data.drop_long_prompts=true to skip such prompts"
            )
        metadata = {"answer": problem.answer, "task_name": problem.task_name, "prompt": last_user_message(problem.messages)}
        records.append(PromptRecord(problem.id, problem.messages, ids, metadata, prompt_tools))
    if dropped:
        print(f"data.{split}: dropped {len(dropped)} prompts longer than {max_prompt_tokens} tokens (first: {dropped[0]})")
    if not records:
        raise ConfigError(f"data.{split}: every prompt is longer than {max_prompt_tokens} tokens; raise policy.max_total_sequence_length")
    return records


def refuse_special_token_texts(tokenizer, problems: list, split: str, prompt_key: str | None) -> None:
    """A :class:`ConfigError` naming the first problem whose messages hold the text of one of ``tokenizer``'s special
    tokens (``<|im_start|>``, an eos): a prompt column that holds text the chat template already rendered was rendered
    again around it, silently (its control tokens then stood inside the user's turn as real special-token ids)."""
    specials = sorted({t for t in getattr(tokenizer, "all_special_tokens", ()) if t}, key=len, reverse=True)
    if not specials:
        return
    pattern = re.compile("|".join(map(re.escape, specials)))
    for problem in problems:
        for message in problem.messages:
            content = message.get("content")
            if isinstance(content, str) and (found := pattern.search(content)):
                raise ConfigError(
                    f"The prompt of {problem.where} (data.{split}) holds the tokenizer's special token {found.group()!r} in its "
                    f"{message.get('role', '')} message: the chat template renders every prompt, so text it rendered already "
                    f"would be wrapped twice. Store the problem's text (data.prompt_key={prompt_key!r}) or its chat messages "
                    "(a list of role/content), or the system prompt without it"
                )


def _refusal_cause(
    tokenizer, messages: list[dict[str, Any]], system_prompt: str | None, refusal: str, prompt_key: str | None
) -> tuple[str, str]:
    """The chat template's refusal of ``messages`` (its message ``refusal``) and the fix to suggest.

    The system prompt is blamed only when the template takes the conversation without the system turn that
    data.system_prompt(_file) inserted. When that rendering fails too, the row's own messages are refused (e.g. roles
    that do not alternate): its refusal is given, with the row's hint."""
    from jinja2 import TemplateError

    row_hint = f"check the row's messages (data.prompt_key={prompt_key!r})"
    if not system_prompt or messages[:1] != [{"role": "system", "content": system_prompt}]:
        return refusal, row_hint
    try:
        render_chat(tokenizer, messages[1:], add_generation_prompt=True)
    except TemplateError as exc:  # the row's own messages are refused as well
        also = "" if str(exc) == refusal else f" (and with the system turn of data.system_prompt(_file): {refusal})"
        return f"{exc}{also}", row_hint
    return refusal, "unset data.system_prompt / data.system_prompt_file"


def check_chat_template(tokenizer) -> None:
    """ConfigError when ``tokenizer`` has no chat template (a base model's): every prompt is rendered with it."""
    if getattr(tokenizer, "chat_template", None):
        return
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    raise ConfigError(
        f"The tokenizer {name!r} (policy.tokenizer_name, or policy.model_name when that is unset) has no chat template, "
        "and prompts are rendered with the tokenizer's chat template. Point policy.tokenizer_name (or policy.model_name) "
        "at a tokenizer that has one, e.g. the instruct/chat version of the model"
    )


def tokenize_conversations(
    tokenizer, conversations: list[list[dict[str, Any]]], tools: Sequence[list[dict[str, Any]] | None] | None = None, chunk: int = 1024
) -> list[list[int]]:
    """Token ids of each conversation through the chat template (with ``tools[i]``'s schemas, where given), ending with
    the generation prompt.

    Same ids as ``apply_chat_template(..., tokenize=True)`` (which encodes the rendered text without
    special tokens), rendered and encoded in batches for speed.
    """
    from jinja2 import TemplateError

    out: list[list[int]] = []
    for start in range(0, len(conversations), chunk):
        texts = []
        for index, messages in enumerate(conversations[start : start + chunk], start):
            try:
                texts.append(render_chat(tokenizer, messages, tools=tools[index] if tools else None, add_generation_prompt=True))
            except TemplateError as exc:  # a template's raise_exception: "System role not supported", roles must alternate
                raise TemplateRefused(index, str(exc)) from exc
        out.extend(list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    return out


class TemplateRefused(Exception):
    """The chat template raised on conversation ``index`` (its own error ``message``)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"conversation {index}: {message}")
        self.index, self.message = index, message


def _arithmetic_problems(data: DataConfig, split: str, fmt) -> list:
    """The built-in synthetic task (ids, prompts and integer answers as generated)."""
    from nemo_like.data.arithmetic import make_arithmetic_problems
    from nemo_like.data.datasets import ARITHMETIC, Problem

    split_cfg = data.train if split == "train" else data.validation
    return [
        Problem(p.id, fmt.messages_for_text(p.prompt), p.answer, ARITHMETIC, f"problem {p.id} of the arithmetic task")
        for p in make_arithmetic_problems(split_cfg.num_problems, seed=split_cfg.seed, split=split)
    ]


def validation_overlap_warning(train: list[PromptRecord], validation: list[PromptRecord]) -> str | None:
    """A warning when validation prompts are also training prompts (the same last user message), e.g. validation
    pointed at the training split or file without ``data.validation.split_fraction``; ``None`` when they are apart."""
    seen = {r.metadata.get("prompt") for r in train}
    shared = sum(r.metadata.get("prompt") in seen for r in validation)
    texts = {r.metadata.get("prompt") for r in validation}
    # One text for every problem (guess-number: the secret differs) names none: a set of several rows, or one row whose
    # text is the only one of a training set of several rows (a one-row training file read as validation is named)
    one_text = len(texts) == 1 and (len(validation) > 1 or (len(seen) == 1 and len(train) > 1))
    if not shared or one_text:
        return None
    return (
        f"{shared} of {len(validation)} validation prompts are also training prompts: validation/accuracy then measures "
        "recall of trained prompts too. Hold rows out with data.validation.split_fraction, or point data.validation at "
        "another split or file"
    )


def dataset_fingerprint(records: list[PromptRecord]) -> str:
    """A short hash of the prompts (ids and tokens): a resumed run checks it sees the same data."""
    digest = hashlib.sha256()
    for r in records:
        digest.update(r.id.encode())
        digest.update(b"\0" + ",".join(map(str, r.prompt_token_ids)).encode() + b"\n")
    return digest.hexdigest()[:16]


def answers_fingerprint(records: list[PromptRecord]) -> str:
    """A short hash of what scores each prompt (its gold answer and its task, i.e. its environment): a resumed run
    checks them too (a guess-number set rebuilt with new secrets has the same prompt texts)."""
    digest = hashlib.sha256()
    for r in records:
        scored = [r.metadata.get("answer"), r.metadata.get("task_name")]
        digest.update(r.id.encode() + b"\0" + json.dumps(scored, sort_keys=True, default=repr).encode() + b"\n")
    return digest.hexdigest()[:16]


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
        self.fingerprint, self.answers_fingerprint = dataset_fingerprint(records), answers_fingerprint(records)
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order. Each epoch trains ``len - len % batch_size`` prompts (no partial batch). Shuffled:
        a fresh seeded permutation, so the prompts left out change. Unshuffled: the rows in file order, continuing
        where the previous epoch stopped (one cyclic stream), so the tail one epoch leaves out heads the next (it
        started at row 0 every time: the same tail was never trained)."""
        n = len(self.records)
        if self.shuffle:
            order = list(range(n))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            return order
        start = epoch * (n - n % self.batch_size) % n
        return [*range(start, n), *range(start)]

    def batches_in(self, epochs: int) -> int:
        """Batches ``epochs`` passes hold (each epoch's incomplete tail is skipped)."""
        return epochs * (len(self.records) // self.batch_size)

    @property
    def next_batch_epoch(self) -> int:
        """The epoch the next batch comes from (the next one once this epoch has no full batch left)."""
        return self.epoch + 1 if self.index + self.batch_size > len(self._order) else self.epoch

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

    def state_dict(self) -> dict[str, int | str]:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "consumed": self.consumed,
            "fingerprint": self.fingerprint,
            "answers_fingerprint": self.answers_fingerprint,
        }

    def check_resumable(self, state: dict[str, int | str]) -> None:
        """A :class:`ConfigError` unless the training prompts are the ones ``state`` (a checkpoint's) was saved with."""
        saved = state.get("fingerprint")
        if saved is not None and saved != self.fingerprint:
            raise ConfigError(
                f"The training prompts differ from the ones the checkpoint was trained on (fingerprint {saved} != "
                f"{self.fingerprint}): the data config or files changed, so resuming would skip or repeat prompts"
                + (
                    ", or the tool lists rendered into them (env.<task>.tools_in_prompt; a checkpoint written before tool "
                    "lists were rendered resumes with env.<task>.tools_in_prompt=false)"
                    if any(r.tools for r in self.records)
                    else ""
                )
                + ". Restore the data, or start a new run in another checkpointing.checkpoint_dir"
            )
        saved = state.get("answers_fingerprint")  # absent from checkpoints saved before it was kept
        if saved is not None and saved != self.answers_fingerprint:
            raise ConfigError(
                "The training prompts' gold answers or tasks differ from the ones the checkpoint was trained on "
                f"(fingerprint {saved} != {self.answers_fingerprint}): the data files changed (data.answer_key's column, "
                "data.task_key's), so the resumed steps would be scored against other answers or by other environments. "
                "Restore the data, or start a new run in another checkpointing.checkpoint_dir"
            )

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Resume at ``state``'s position; the training prompts must be the ones it was saved with."""
        self.check_resumable(state)
        self.epoch, self.index, self.consumed = state["epoch"], state["index"], state["consumed"]
        self._order = self._epoch_order(self.epoch)
