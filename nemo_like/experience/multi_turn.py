"""Multi-turn rollouts, token-in / token-out: generate -> environment step -> observation -> generate again.

Each sample is one growing token sequence, built only by appending:

* the prompt's ids (as the data tokenised them),
* each model turn's **sampled ids**, exactly as the engine returned them (never decoded and re-encoded),
  the end-of-turn token included; their generation logprobs are kept one per token,
* each observation's ids: the chat template's rendering of ``conversation + observation`` (with the
  next assistant generation prompt) minus the rendering the sequence already holds, tokenised in context
  (:func:`in_context_ids`: the ids the whole rendering's tokenisation gives it, what a server rendering the
  conversation feeds the model).

The result is one :class:`~nemo_like.models.generation.interface.GeneratedSample` per sample whose
``response_ids`` are everything after the prompt and whose ``response_mask`` is 1 on sampled ids and 0
on observation ids, so the training batch, the loss and the logprob passes need no special case.

The loop checks that every rendering extends the text the sequence encodes. Where the template rewrites what the
sequence already holds, the sample **branches** (:func:`start_row`), as the rollout server's sessions do: its row ends
after the model's turn, and a new row starts whose prompt is the template's whole rendering of the conversation and the
observation (masked out), so every sampled token is trained once, in the context it was sampled in, and no context the
model never saw is trained on. The episode goes on; all its rows share its reward and weigh once in its group's
baseline (``Rollout.session_of_row``). Counted per cause: a turn ended on an end token the template replaces with its
own (:data:`FOREIGN_END`), whitespace the template drops or adds around it (:data:`WHITESPACE_REWRITE`: Llama 3.x's,
Gemma's and Mistral's ``| trim``, Llama 2's ``' ' + content + ' '``), any other rewrite (:data:`TEMPLATE_REWRITE`:
Qwen3's and DeepSeek-R1's templates drop earlier turns' reasoning once a user message follows).

Turns are batched across the samples still running; a sample ends when its environment says
``terminated``, when ``max_turns`` model turns are done, when a turn ends without a stop (hit its token
budget: ``truncated``), or when ``max_total_length`` leaves no room for another token or observation
(``length_truncated``; ``truncated`` too only when the last turn was cut before its stop, as ``truncated`` means
everywhere: ``train/truncated_fraction`` had counted turns that stopped on their end token).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from nemo_like.config.errors import ConfigError
from nemo_like.data.prompts import PromptRecord
from nemo_like.environments.interface import (
    FINAL_TURN,
    FOREIGN_END,
    OBSERVATION_DROPPED,
    TEMPLATE_REWRITE,
    WHITESPACE_REWRITE,
    EnvironmentStep,
)
from nemo_like.environments.registry import TASK_KEY
from nemo_like.models.generation.interface import GeneratedSample, GenerationInterface, SamplingParams, stop_string_prefix
from nemo_like.models.loading import added_token_texts, decode_exact, render_chat
from nemo_like.plan.multi_turn import ANY_REPLY_ROLES, MultiTurnSettings
from nemo_like.utils.seeds import turn_seed


class TemplateRewriteError(ConfigError):
    """The chat template renders the conversation so far differently from the tokens already in the sequence."""


class EnvironmentStepper(Protocol):
    """Runs one environment turn for a batch of conversations: ``(steps, counters)``."""

    def __call__(
        self, prompts: list[PromptRecord], message_logs: list[list[dict[str, str]]], metadata: list[dict[str, Any]]
    ) -> tuple[list[EnvironmentStep], dict[str, float]]: ...


@dataclass
class Conversation:
    """One sample's state during the turn loop."""

    prompt: PromptRecord
    messages: list[dict[str, str]]  # the whole conversation (prompt messages first)
    metadata: dict[str, Any]
    text: str  # the text the sequence's ids encode (the template's rendering, plus sampled text)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    weight_version: int | None = None
    final_weight_version: int | None = None
    stop_strings: list[str] | None = None  # extra stop strings for the next turn (from the last step)
    step_metrics: dict[str, float] = field(default_factory=dict)  # EnvironmentStep.metrics summed over the steps
    done: bool = False
    truncated: bool = False
    length_truncated: bool = False
    turn_start: int = 0  # where the last model turn's text starts in ``text``
    turn_start_id: int = 0  # where its ids start in the row's ids (``prompt_ids + response_ids``)
    foreign_end: bool = False  # the last turn ended on an eos the template does not write: it cannot be continued
    decoded_tokens: int = 0  # tokens the engine decoded over the row's turns (stop-string cuts included)
    prompt_ids: list[int] = field(default_factory=list)  # the row's prompt: the prompt's ids, or a branch's rendering
    rows: list[GeneratedSample] = field(default_factory=list)  # the rows finished before the row being built
    row_first_turn: int = 0  # the first model turn of the row being built
    prompt_observation_tokens: int = 0  # a branch's row: its prompt's tokens of the branching observation's content

    @property
    def length(self) -> int:
        """Tokens in the row being built (what ``policy.max_total_sequence_length`` bounds)."""
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class MultiTurnResult:
    """The finished rows (prompt order; a branched sample's rows adjacent), each its sample's total reward and index
    (``session_of_row``), its decoded response, and the counters."""

    samples: list[GeneratedSample]
    rewards: torch.Tensor  # [R] sum of each row's sample's step rewards
    texts: list[str]  # everything after each row's prompt, decoded with special tokens (what was trained on)
    env_metrics: dict[str, float]
    generation_seconds: float
    env_seconds: float
    session_of_row: list[int] = field(default_factory=list)  # [R] the sample (its index in ``prompts``) of each row


@dataclass
class EpisodeTotals:
    """One sample's episode over its rows (one row unless it branched: :func:`start_row`)."""

    turns: int = 0
    rows: int = 0
    length_truncated: bool = False  # its last row's
    observation_tokens: int = 0
    step_metrics: dict[str, float] = field(default_factory=dict)
    reward: float = 0.0


def episode_totals(samples: Sequence[GeneratedSample], rewards: torch.Tensor, session_of_row: Sequence[int] | None) -> list[EpisodeTotals]:
    """Rows -> episodes (first-seen order): turns, observation tokens and step metrics summed over an episode's rows;
    its reward its first row's (every row holds it). ``session_of_row`` None: one row per episode."""
    owners = range(len(samples)) if session_of_row is None else [int(o) for o in session_of_row]
    episodes: dict[int, EpisodeTotals] = {}
    for owner, sample, reward in zip(owners, samples, rewards.tolist()):
        episode = episodes.setdefault(owner, EpisodeTotals(reward=float(reward)))
        episode.turns += sample.num_turns
        episode.rows += 1
        episode.length_truncated = sample.length_truncated
        episode.observation_tokens += len(sample.response_ids) - sample.num_sampled_tokens + sample.prompt_observation_tokens
        for name, value in (sample.step_metrics or {}).items():
            episode.step_metrics[name] = episode.step_metrics.get(name, 0.0) + value
    return list(episodes.values())


def multi_turn_metrics(
    samples: Sequence[GeneratedSample], rewards: torch.Tensor, prefix: str = "multi_turn", session_of_row: Sequence[int] | None = None
) -> dict[str, float]:
    """Per sample (an episode, over its rows where it branched: ``session_of_row``): turns (mean, max), rows (mean),
    the fraction cut by the length limit, observation tokens (mean), the mean reward of the samples with each turn count
    (``<prefix>/reward_turns_<k>``), and per step metric name (``EnvironmentStep.metrics`` and the loop's own counters)
    its mean per sample and the share of samples where it is non-zero."""
    return episode_metrics(episode_totals(samples, rewards, session_of_row), prefix)


def episode_metrics(episodes: Sequence[EpisodeTotals], prefix: str = "multi_turn") -> dict[str, float]:
    """:func:`multi_turn_metrics` of ``episodes`` (:func:`episode_totals`: an eval gathers its chunks' episodes)."""
    turns = torch.tensor([e.turns for e in episodes], dtype=torch.float32)
    episode_rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
    metrics = {
        f"{prefix}/turns_per_sample_mean": turns.mean().item(),
        f"{prefix}/turns_per_sample_max": turns.max().item(),
        f"{prefix}/rows_per_sample": sum(e.rows for e in episodes) / len(episodes),
        f"{prefix}/truncated_by_length_fraction": sum(e.length_truncated for e in episodes) / len(episodes),
        f"{prefix}/observation_tokens_per_sample": sum(e.observation_tokens for e in episodes) / len(episodes),
    }
    for k in sorted({int(t) for t in turns.tolist()}):
        metrics[f"{prefix}/reward_turns_{k}"] = episode_rewards[turns == k].mean().item()
        metrics[f"{prefix}/fraction_turns_{k}"] = (turns == k).float().mean().item()
    for name in sorted({name for e in episodes for name in e.step_metrics}):
        values = [e.step_metrics.get(name, 0.0) for e in episodes]
        metrics[f"{prefix}/{name}_per_sample"] = sum(values) / len(values)
        metrics[f"{prefix}/{name}_sample_fraction"] = sum(v != 0 for v in values) / len(values)
    return metrics


def render(tokenizer, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> str:
    """The chat template's text of ``messages`` (with the prompt's ``tools``) followed by the assistant generation prompt."""
    return render_chat(tokenizer, messages, tools=tools, add_generation_prompt=True)


def start_conversation(tokenizer, prompt: PromptRecord) -> Conversation:
    """The state before the first turn; the prompt's ids must be the template's rendering of its messages."""
    text = render(tokenizer, prompt.messages, prompt.tools)
    if tokenizer(text, add_special_tokens=False)["input_ids"] != list(prompt.prompt_token_ids):
        raise TemplateRewriteError(
            f"prompt {prompt.id}: its token ids are not the chat template's rendering of its messages; multi-turn rollouts "
            "append observations to the template's text, so the prompt must be tokenised by the same template"
        )
    return Conversation(prompt, [dict(m) for m in prompt.messages], dict(prompt.metadata), text, prompt_ids=list(prompt.prompt_token_ids))


@dataclass(frozen=True)
class Continuation:
    """What follows the model's turn (:func:`continuation`): ``ids`` (``text``) appended to the row, or, where the
    template cannot extend the row token-exactly, ``branch`` (the cause's step counter) with the template's whole
    rendering as the prompt of the row that starts (:func:`start_row`)."""

    text: str
    ids: list[int]
    branch: str | None = None

    def length_after(self, conv: Conversation) -> int:
        """The tokens of the row that holds the continuation."""
        return len(self.ids) if self.branch else conv.length + len(self.ids)


def continuation(tokenizer, conv: Conversation, observation: dict[str, str] | None) -> Continuation:
    """The template's rendering of the conversation plus ``observation`` (and the next generation prompt): minus the
    text the row already holds, tokenised in context, where it starts with that text and the last turn did not end on
    a foreign end id; else the whole rendering, a branch, its cause :data:`FOREIGN_END`, :data:`WHITESPACE_REWRITE`
    or :data:`TEMPLATE_REWRITE`, tokenised as the rollout server does: where the rendering keeps the row up to the last
    turn (a trimmed turn, a foreign end), those ids as sampled and the rest in context; else whole."""
    full = render(tokenizer, conv.messages + ([observation] if observation is not None else []), conv.prompt.tools)
    if not conv.foreign_end and full.startswith(conv.text):
        text = full[len(conv.text) :]
        return Continuation(text, in_context_ids(tokenizer, conv.text, text, searched_from=conv.turn_start - ADDED_TOKEN_WINDOW))
    cause = FOREIGN_END if conv.foreign_end else WHITESPACE_REWRITE if rewrote_only_whitespace(conv, full) else TEMPLATE_REWRITE
    kept = conv.text[: conv.turn_start]
    if conv.turn_start and full.startswith(kept):  # an earlier turn re-tokenised lost the ids the model sampled
        rest = in_context_ids(tokenizer, kept, full[len(kept) :], searched_from=conv.turn_start - ADDED_TOKEN_WINDOW)
        return Continuation(full, (conv.prompt_ids + conv.response_ids)[: conv.turn_start_id] + rest, cause)
    return Continuation(full, list(tokenizer(full, add_special_tokens=False)["input_ids"]), cause)


def in_context_ids(tokenizer, before: str, text: str, searched_from: int | None = None) -> list[int]:
    """The ids of ``text`` where it follows ``before``: the tail of ``before + text``'s ids after ``before``'s own.

    Tokenised alone, a SentencePiece tokenizer starts ``text`` with a ``▁`` word marker that the whole text's ids do not
    hold (a non-legacy one adds it only at the start of its input; a legacy one after every special token, where the
    whole text's ids hold it too). When the two tokenisations disagree on ``before`` (a merge across the boundary), the
    ids of ``text`` alone. Only ``before``'s tail from its last added token is tokenised (an added token is one id
    whatever surrounds it, so the text after it tokenises the same): the whole conversation twice per turn cost
    ~1 ms per 1,000 tokens of it. The added token is looked for from ``searched_from`` (the rollout: a window before
    the last model turn, whose generation prompt ends with one however long the turn ran) or the last
    :data:`ADDED_TOKEN_WINDOW` characters."""
    start = len(before) - ADDED_TOKEN_WINDOW if searched_from is None else min(searched_from, len(before) - ADDED_TOKEN_WINDOW)
    before = before[_last_added_token_start(tokenizer, before, max(0, start)) :]
    head = tokenizer(before, add_special_tokens=False)["input_ids"]
    whole = tokenizer(before + text, add_special_tokens=False)["input_ids"]
    if whole[: len(head)] == head:
        return list(whole[len(head) :])
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


#: How far back :func:`in_context_ids` looks for an added token (a turn's end token is usually the last thing before).
ADDED_TOKEN_WINDOW = 4096


def _last_added_token_start(tokenizer, text: str, start: int) -> int:
    """Where the last added token (``<|im_end|>``, any special or added token) starts in ``text[start:]``; 0 (all of
    it) when none does."""
    found = max((text.rfind(token, start) for token in added_token_texts(tokenizer)), default=-1)
    return max(found, 0)


def stop_string_cut(tokenizer, ids: list[int], stop_strings: Sequence[str], before: Sequence[int] = ()) -> int | None:
    """Length of the shortest prefix of ``ids`` whose text (decoded after ``before``: :func:`decode_in_context`) contains
    a stop string (whole tokens kept), or ``None``."""
    return stop_string_prefix(ids, lambda prefix: decode_in_context(tokenizer, before, prefix), stop_strings)


def apply_stop_strings(tokenizer, sample: GeneratedSample, stop_strings: Sequence[str], before: Sequence[int] = ()) -> GeneratedSample:
    """``sample`` cut after the token that completes the first stop string (then it is not truncated); ``before``: the
    ids the response follows (a SentencePiece turn's first space counts: a stop string ``' 7'``)."""
    cut = stop_string_cut(tokenizer, sample.response_ids, stop_strings, before)
    if cut is None:
        return sample
    kept = dict(response_ids=sample.response_ids[:cut], response_logprobs=sample.response_logprobs[:cut], truncated=False)
    return replace(sample, **kept, decoded_tokens=sample.num_decoded_tokens, final_weight_version=sample.kept_version(cut))


@dataclass(frozen=True)
class TurnEnds:
    """What a turn's last token means for its message (:func:`turn_ends`): ``removed`` ids are left out of the message
    (the template writes its own end back); ``foreign`` ones (removed too) end the episode: the template writes another
    end token in their place, so no observation can extend the sequence token-exactly. A stop id in neither (the
    recipe's ``</tool_call>``) is part of the text, as a stop string is."""

    removed: frozenset[int]
    foreign: frozenset[int]


def turn_ends(tokenizer, settings: MultiTurnSettings) -> TurnEnds:
    """The run's end ids sorted by :func:`writes_back`: the tokenizer's eos ids are end-of-turn tokens (foreign where
    the template does not write them back: Qwen's ``<|endoftext|>`` beside ``<|im_end|>``); the recipe's own stop ids
    are end-of-turn tokens where the template writes them back (``<|im_end|>`` for a base tokenizer), else text."""
    recipe = set(settings.recipe_stop_ids)
    written = {i for i in settings.eos_token_ids if writes_back(tokenizer, i)}
    eos = set(settings.eos_token_ids) - recipe
    return TurnEnds(removed=frozenset(eos | (recipe & written)), foreign=frozenset(eos - written))


#: The content of the neutral assistant turn :func:`writes_back` renders (digits: a template's trim, upper- or lower-casing
#: leaves them as they are).
PROBE_CONTENT = "4711"


def writes_back(tokenizer, token_id: int) -> bool:
    """Whether the chat template writes ``token_id``'s text after an assistant turn's content (whitespace between
    allowed: Llama 2's ``' </s>'``) when the conversation goes on, as the rollout renders it: the turn's end, not a tag
    that opens the next turn (Phi-3's ``<|assistant|>``, a base model's ``<|im_start|>``) nor the end of a final message
    only (gpt-oss's ``<|return|>``). Decided on a neutral turn, whatever a sampled turn holds; where the template drops
    that content, on the turn as the last message, then by whether one assistant message more holds the text once more."""
    end = decode_exact(tokenizer, [token_id])
    if not end:
        return False
    user, turn = {"role": "user", "content": "q"}, {"role": "assistant", "content": PROBE_CONTENT}
    for messages, prompt in (([user, turn, user], True), ([user, turn], False)):
        text = render_chat(tokenizer, messages, add_generation_prompt=prompt)
        if PROBE_CONTENT in text:
            return text[text.rindex(PROBE_CONTENT) + len(PROBE_CONTENT) :].lstrip().startswith(end)
    with_turn = render_chat(tokenizer, [user, turn], add_generation_prompt=False)
    return with_turn.count(end) > render_chat(tokenizer, [user], add_generation_prompt=False).count(end)


def decode_in_context(tokenizer, before: Sequence[int], ids: Sequence[int]) -> str:
    """The text ``ids`` add after ``before`` (the sequence so far): decoded after its last id and cut, so that a
    SentencePiece tokenizer keeps the space of a first ``▁7`` that decoding ``ids`` alone drops (``[/INST] 7``, as the
    template writes it). ``ids`` alone where the two decodings disagree on ``before``'s part, or where that id alone is
    no whole character (a byte-fallback token: the bytes after it would be read into it)."""
    context = list(before[-1:])
    head = decode_exact(tokenizer, context)
    whole = decode_exact(tokenizer, [*context, *ids])
    if context and "\ufffd" not in head and whole.startswith(head):
        return whole[len(head) :]
    return decode_exact(tokenizer, ids)


def append_turn(tokenizer, conv: Conversation, sample: GeneratedSample, ends: TurnEnds, recipe_stops: Sequence[str] = ()) -> None:
    """Append one model turn's sampled ids, logprobs and message, cut at the recipe's stop strings and the ones
    the sample's last environment step added; ``ends`` says whether its last token belongs to the message."""
    before = (conv.response_ids or conv.prompt_ids)[-1:]  # the sequence's last id: the turn's context
    sample = apply_stop_strings(tokenizer, sample, [*recipe_stops, *(conv.stop_strings or ())], before)
    ids, logprobs, truncated = list(sample.response_ids), list(sample.response_logprobs), sample.truncated
    conv.decoded_tokens += sample.num_decoded_tokens
    conv.turn_start_id = len(conv.prompt_ids) + len(conv.response_ids)
    conv.response_ids += ids
    conv.response_mask += [1] * len(ids)
    conv.response_logprobs += logprobs
    conv.turn_start = len(conv.text)
    conv.text += decode_in_context(tokenizer, before, ids)
    last = ids[-1] if ids and not truncated else None
    # The message holds the turn's text without the template's end-of-turn token (the template adds it back).
    content_ids = ids[:-1] if last in ends.removed else ids
    conv.messages.append({"role": "assistant", "content": decode_in_context(tokenizer, before, content_ids)})
    conv.foreign_end = last in ends.foreign
    conv.turns += 1
    conv.weight_version = sample.weight_version if conv.weight_version is None else min(conv.weight_version, sample.weight_version)
    conv.final_weight_version = sample.final_weight_version if sample.final_weight_version is not None else sample.weight_version
    conv.truncated = truncated


def ends_after_step(
    tokenizer, conv: Conversation, last_turn: bool, max_total_length: int, reply_roles: Sequence[str] = ANY_REPLY_ROLES
) -> bool:
    """Whether :func:`apply_step` ends the sample whatever its environment answers: its last allowed turn, a turn cut
    by its token budget, or no room left for the shortest observation plus one sampled token. The shortest is what the
    template appends with no new message (the turn's end and the next generation prompt); any observation adds its
    message to that. Counting one token for it had told an environment "not final" for turns that then ended on the
    length limit (its final-turn outcome never counted, its observation built for nothing). Where the row is full, a
    reply the template rewrites the history for (an empty one of each role of ``reply_roles``, the environment's
    :meth:`~nemo_like.environments.interface.EnvironmentInterface.reply_roles`) starts a new row, which may hold it: a
    long reasoning turn a Qwen3-style template then drops for a user's reply (it was told final, and ended with no
    reward); a tool's reply it keeps, so a tool environment's full row stays final."""
    if last_turn or conv.truncated:
        return True
    shortest = continuation(tokenizer, conv, None)
    if shortest.branch:  # the new row: its prompt and one sampled token
        return shortest.length_after(conv) >= max_total_length
    if conv.length + max(1, len(shortest.ids)) < max_total_length:
        return False
    return not any(branch.length_after(conv) < max_total_length for branch in reply_branches(tokenizer, conv, reply_roles))


def reply_branches(tokenizer, conv: Conversation, roles: Sequence[str]) -> list[Continuation]:
    """The branches an empty reply of each of ``roles`` would start (none where it extends the row, or where the
    template refuses that role)."""
    branches = []
    for role in roles:
        try:
            follows = continuation(tokenizer, conv, {"role": role, "content": ""})
        except Exception:  # noqa: BLE001 - a template that refuses the role: no such reply
            continue
        if follows.branch:
            branches.append(follows)
    return branches


def apply_step(
    tokenizer, conv: Conversation, step: EnvironmentStep, last_turn: bool, max_total_length: int, told_final: bool = False
) -> None:
    """Add the step's reward and decide whether the sample goes on (appending the observation's ids) or ends.
    ``told_final``: :func:`ends_after_step` told the environment this turn was the last (so it built no observation)."""
    conv.reward += float(step.reward)
    for name, value in (step.metrics or {}).items():
        conv.step_metrics[name] = conv.step_metrics.get(name, 0.0) + float(value)
    if step.metadata is not None:
        conv.metadata = {k: v for k, v in step.metadata.items() if k != FINAL_TURN}
    if step.terminated or last_turn or conv.truncated:  # ends_after_step told the environment so before its step
        conv.done = True
        return
    if told_final:  # no room for even the shortest observation: the environment knew (and counted its own outcome)
        conv.done = conv.length_truncated = True  # truncated stays the turn's own: did it stop
        return
    follows = continuation(tokenizer, conv, step.observation)
    if follows.length_after(conv) >= max_total_length:  # no room for the observation and one more sampled token
        conv.done = conv.length_truncated = True  # truncated stays the turn's own: did it stop
        # The environment was told "not final" (the shortest observation fit), so it ran the turn (a tool call, say)
        # for an observation the sample never sees: counted, so a budget too tight for the observations shows.
        count(conv, OBSERVATION_DROPPED)
        return
    if follows.branch:
        start_row(conv, follows)
        conv.prompt_observation_tokens = content_tokens(tokenizer, conv, step.observation, follows)
    else:
        conv.response_ids += follows.ids
        conv.response_mask += [0] * len(follows.ids)
        conv.response_logprobs += [0.0] * len(follows.ids)
        conv.text += follows.text
    if step.observation is not None:
        conv.messages.append(dict(step.observation))
    conv.stop_strings = step.stop_strings


def start_row(conv: Conversation, follows: Continuation) -> None:
    """Branch: the row built so far ends after the model's turn (:func:`finished_sample`) and a new one starts whose
    prompt is the template's whole rendering (``follows``: the conversation and the observation, masked out), as a
    server that renders the conversation feeds the model; counted in ``follows.branch``. The earlier turns' sampled
    ids stay trained in the row they were sampled in; the episode, its reward and its turn budget go on."""
    count(conv, follows.branch)
    conv.rows.append(finished_sample(conv))
    conv.prompt_ids, conv.text, conv.turn_start, conv.turn_start_id = list(follows.ids), follows.text, len(follows.text), len(follows.ids)
    conv.response_ids, conv.response_mask, conv.response_logprobs = [], [], []
    conv.step_metrics, conv.decoded_tokens, conv.row_first_turn = {}, 0, conv.turns


def content_tokens(tokenizer, conv: Conversation, observation: dict[str, str] | None, follows: Continuation) -> int:
    """The tokens ``observation``'s content takes in a branch's rendering ``follows`` of the conversation and it (0
    without one): that rendering's length less the same conversation's with the content empty (what
    ``multi_turn/observation_tokens_per_sample`` counts for a branch; its role markers, counted in an unbranched row,
    are not: the rest of the rendering is the history, rewritten)."""
    if observation is None:
        return 0
    empty = render(tokenizer, conv.messages + [{**observation, "content": ""}], conv.prompt.tools)
    return max(0, len(follows.ids) - len(tokenizer(empty, add_special_tokens=False)["input_ids"]))


def count(conv: Conversation, counter: str) -> None:
    """Add 1 to the row's step counter ``counter``."""
    conv.step_metrics[counter] = conv.step_metrics.get(counter, 0.0) + 1.0


def rewrote_only_whitespace(conv: Conversation, full: str) -> bool:
    """Whether the template's rendering ``full`` of the conversation (and the observation) keeps the earlier turns and
    differs from the last turn's text (with its end) only in whitespace: a trimming template, or one that adds a space.
    A template that rewrites more (drops earlier turns' or this turn's reasoning, changes the content) is not."""
    if not full.startswith(conv.text[: conv.turn_start]):
        return False
    return _without_whitespace(full[conv.turn_start :]).startswith(_without_whitespace(conv.text[conv.turn_start :]))


def _without_whitespace(text: str) -> str:
    return "".join(text.split())


def trimming_template_warning(tokenizer) -> str | None:
    """A warning for multi-turn runs when the chat template trims message content (Llama 3.x, Gemma: ``| trim``):
    a turn that begins or ends with whitespace then branches its episode (:func:`start_row`, :data:`WHITESPACE_REWRITE`)."""
    turn = " x \n"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": turn}]
    if turn in render_chat(tokenizer, messages, add_generation_prompt=False):
        return None
    return (
        "the chat template trims message content (it does not write back an assistant turn ' x \\n' as sampled): in "
        "multi-turn rollouts an episode goes on after a turn that begins or ends with whitespace in a new training row "
        f"whose prompt is the whole conversation (counted in multi_turn/{WHITESPACE_REWRITE}_per_sample): more rows and "
        "prompt tokens to train on; a template that keeps content as it is avoids it"
    )


def _keeps_turn(tokenizer, prompt: list[dict[str, str]], sampled: str, reply_role: str) -> bool:
    """Whether the template renders ``prompt``, the sampled assistant turn and a ``reply_role`` reply starting with
    what the sequence holds after the turn (whitespace aside: the turn loop ends such an episode, counted)."""
    opened = render_chat(tokenizer, prompt, add_generation_prompt=True)
    history = [*prompt, {"role": "assistant", "content": sampled}, {"role": reply_role, "content": "z"}]
    full = render_chat(tokenizer, history, add_generation_prompt=True)
    return _without_whitespace(full).startswith(_without_whitespace(opened + sampled))


def rewriting_template_warning(tokenizer) -> str | None:
    """A warning for multi-turn runs when the chat template renders an earlier assistant turn, or the prompt, otherwise
    than the sequence holds them once a user message follows (Qwen3's and DeepSeek-R1's drop the reasoning block from
    earlier turns, the empty one their generation prompt opens included; Mistral's move the system message before the
    last user message): such an episode goes on in a new row at that turn (:func:`start_row`, :data:`TEMPLATE_REWRITE`).
    Whitespace-only rewrites are :func:`trimming_template_warning`'s."""
    user, system = {"role": "user", "content": "q"}, {"role": "system", "content": "s"}
    cases = (
        ([user], "x", "it drops the reasoning block its generation prompt opens"),
        ([user], "<think>\nr\n</think>\n\nx", "it drops a reasoning block the model writes"),
        ([system, user], "x", "it moves the system message"),
    )
    for prompt, sampled, what in cases:
        if _keeps_turn(tokenizer, prompt, sampled, "user"):
            continue
        # a tool's reply is spared only where it keeps every case (Qwen3's drops the empty block for a user only, and a
        # block the model writes for either)
        spared = all(_keeps_turn(tokenizer, p, s, "tool") for p, s, _ in cases)
        tool = "; an environment replying as a tool is not affected" if spared else ""
        return (
            f"the chat template renders an earlier assistant turn or the prompt otherwise than the sequence holds them "
            f"once a user message follows ({what}): a multi-turn episode whose environment replies as a user goes on "
            "from that turn in a new training row whose prompt is the whole conversation as the template renders it "
            f"(counted in multi_turn/{TEMPLATE_REWRITE}_per_sample): more rows and prompt tokens to train on{tool}. A "
            "tokenizer whose template keeps earlier turns as they were (policy.tokenizer_name) trains each episode as one row"
        )
    return None


def template_warnings(tokenizer) -> list[str]:
    """What a multi-turn run should know of its chat template: :func:`trimming_template_warning`,
    :func:`rewriting_template_warning`."""
    return [line for line in (trimming_template_warning(tokenizer), rewriting_template_warning(tokenizer)) if line]


def finished_sample(conv: Conversation) -> GeneratedSample:
    """The row being built as a training row (the conversation's turns after the prompt so far as ``messages``; its
    own turns, step counters and decoded tokens: an episode's are the sums over its rows)."""
    return GeneratedSample(
        prompt_ids=list(conv.prompt_ids),
        response_ids=conv.response_ids,
        response_logprobs=conv.response_logprobs,
        truncated=conv.truncated,
        weight_version=conv.weight_version if conv.weight_version is not None else 0,
        final_weight_version=conv.final_weight_version,
        response_mask=conv.response_mask,
        num_turns=conv.turns - conv.row_first_turn,
        prompt_observation_tokens=conv.prompt_observation_tokens,
        length_truncated=conv.length_truncated,
        messages=conv.messages[len(conv.prompt.messages) :],
        step_metrics=dict(conv.step_metrics),
        decoded_tokens=conv.decoded_tokens if conv.decoded_tokens != sum(conv.response_mask) else None,
    )


def task_name(conv: Conversation) -> str | None:
    """The task of the conversation's prompt (``metadata["task_name"]``), if it names one."""
    return conv.prompt.metadata.get(TASK_KEY)


def generate_turn(
    generation: GenerationInterface, active: list[Conversation], params: SamplingParams, seed: int, turn: int, max_total_length: int
) -> list[GeneratedSample]:
    """One model turn for every active conversation: each gets at most the tokens left before
    ``max_total_length`` (samples with the same budget share one generate call)."""
    by_budget: dict[int, list[int]] = defaultdict(list)
    for index, conv in enumerate(active):
        by_budget[min(params.max_new_tokens, max_total_length - conv.length)].append(index)
    out: list[GeneratedSample | None] = [None] * len(active)
    for group, (budget, rows) in enumerate(sorted(by_budget.items(), reverse=True)):
        prompts = [active[i].prompt_ids + active[i].response_ids for i in rows]
        samples = generation.generate(prompts, replace(params, max_new_tokens=budget), turn_seed(seed, turn, group))
        for i, sample in zip(rows, samples):
            out[i] = sample
    return out  # type: ignore[return-value]


def run_multi_turn(
    generation: GenerationInterface,
    step_environments: EnvironmentStepper,
    tokenizer,
    prompts: list[PromptRecord],
    params: SamplingParams,
    seed: int,
    settings: MultiTurnSettings,
) -> MultiTurnResult:
    """Run every sample (one per entry of ``prompts``) to its end; see the module docstring."""
    max_turns, max_total_length = settings.max_turns, settings.max_total_length
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    convs = [start_conversation(tokenizer, p) for p in prompts]
    for conv in convs:
        if conv.length >= max_total_length:
            raise ConfigError(
                f"prompt {conv.prompt.id} has {conv.length} tokens, no room under policy.max_total_sequence_length={max_total_length}"
            )
    ends = turn_ends(tokenizer, settings)
    counters: dict[str, float] = {}
    gen_s = env_s = 0.0
    for turn in range(max_turns):
        active = [c for c in convs if not c.done]
        if not active:
            break
        start = time.perf_counter()
        samples = generate_turn(generation, active, params, seed, turn, max_total_length)
        for conv, sample in zip(active, samples):
            append_turn(tokenizer, conv, sample, ends, params.stop_strings)
            if conv.truncated and conv.length >= max_total_length:
                conv.length_truncated = True
        gen_s += time.perf_counter() - start
        start = time.perf_counter()
        last_turn = turn == max_turns - 1
        finals = [ends_after_step(tokenizer, c, last_turn, max_total_length, settings.reply_roles_of(task_name(c))) for c in active]
        metadata = [{**c.metadata, FINAL_TURN: final} for c, final in zip(active, finals)]
        steps, step_counters = step_environments([c.prompt for c in active], [c.messages for c in active], metadata)
        env_s += time.perf_counter() - start
        for name, value in step_counters.items():
            counters[name] = counters.get(name, 0.0) + value
        for conv, step, final in zip(active, steps, finals):
            apply_step(tokenizer, conv, step, last_turn, max_total_length, told_final=final)
    samples, session_of_row = [], []
    for index, conv in enumerate(convs):
        last = finished_sample(conv)
        # Every row of an episode is as old as its first turn (what a staleness bound counts from), as a session's.
        samples += [replace(row, weight_version=last.weight_version) for row in conv.rows] + [last]
        session_of_row += [index] * (len(conv.rows) + 1)
    texts = [decode_in_context(tokenizer, s.prompt_ids, s.response_ids) for s in samples]
    rewards = torch.tensor([convs[i].reward for i in session_of_row], dtype=torch.float32)
    return MultiTurnResult(samples, rewards, texts, counters, gen_s, env_s, session_of_row)


def local_stepper(envs: dict[str, Any]) -> EnvironmentStepper:
    """Step in-process environment objects by task (tests and single-process tools); counters as ``env/<task>/<name>``."""
    from nemo_like.environments.registry import route_by_task

    def step(prompts, message_logs, metadata):
        steps: list[EnvironmentStep | None] = [None] * len(prompts)
        counters: dict[str, float] = {}
        for task, rows in route_by_task([p.metadata for p in prompts], list(envs)).items():
            for row, result in zip(rows, envs[task].step([message_logs[i] for i in rows], [metadata[i] for i in rows])):
                steps[row] = result
            for name, value in envs[task].metrics().items():
                counters[f"env/{task}/{name}"] = counters.get(f"env/{task}/{name}", 0.0) + float(value)
        return steps, counters

    return step


def ray_stepper(envs: Any) -> Callable:
    """Step the run's environment actors (:class:`~nemo_like.environments.worker.EnvironmentHandles`): samples
    routed by their prompt's task, each task's samples sharded over its actors, all concurrently."""
    from nemo_like.experience.env_calls import call_environments

    def step(prompts, message_logs, metadata):
        routing = [p.metadata for p in prompts]
        return call_environments(envs, "step", message_logs, metadata, "environment step", routing).gather()

    return step
