"""A session's calls -> training rows (the sampled ids masked in, everything else masked out).

Rules (``docs/guides/agents.md``):

* Calls are taken in the order they were recorded. A call **extends** a row when the row's ids so far (its prompt,
  then every earlier call's observation and sampled ids) are a prefix of the call's prompt ids; the tokens between
  (tool results, the template's role markers) join the row masked out, the call's sampled ids masked in. Among the
  rows a call extends it joins the longest.
* A call that extends no row (a template that rewrote history, context compaction, a sub-agent, a second choice of
  ``n``) starts a new row whose prompt is the call's whole prompt, masked out ("branching"). All rows of a session
  share its reward.

So each sampled token is masked in exactly once, in the context it was sampled in, and no token the model did not
sample is ever masked in. :func:`unsampled_positions` checks that property for any row and is run on every row built
(:func:`session_rows`); a session whose records fail :func:`record_problems` or that check is rejected, never trained.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from nemo_like.models.generation.interface import GeneratedSample


@dataclass(frozen=True)
class CallRecord:
    """One sampled completion of a session: ``logprobs[i]`` = the engine's log p(completion_ids[i] | prompt, ...)."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    weight_version: int  # the weights the completion started with
    final_weight_version: int  # the weights of its last token (differs after an in-flight refit)
    truncated: bool = False  # ended by max_tokens, not a stop token or stop string
    call_index: int = 0  # the HTTP call (per session, in arrival order)
    choice_index: int = 0  # the choice of that call (``n`` > 1)
    decoded_tokens: int | None = None  # tokens the engine decoded for it when more than were kept (a stop cut); None: as many

    @property
    def full_ids(self) -> tuple[int, ...]:
        return self.prompt_ids + self.completion_ids

    @property
    def num_decoded_tokens(self) -> int:
        """Tokens the engine decoded for this completion: its kept tokens and any a stop string or ``max_tokens`` cut."""
        return len(self.completion_ids) if self.decoded_tokens is None else self.decoded_tokens


@dataclass
class TrainingRow:
    """One ``[S]`` row: ``prompt_ids`` then ``response_ids``; ``response_mask[i]`` is 1 exactly where the engine
    sampled ``response_ids[i]`` (its logprob in ``response_logprobs[i]``), 0 on observation tokens (logprob 0)."""

    session_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    reward: float
    weight_versions: list[int]  # per call in the row, the version it started with
    final_weight_version: int
    calls: list[tuple[int, int]]  # (call_index, choice_index) of the calls in the row, in order
    branch: int = 0  # this row's index among the session's rows
    truncated: bool = False  # its last call ended by max_tokens
    decoded_tokens: int = 0  # tokens the engine decoded for the row's calls (their stop cuts' tails included)

    @property
    def weight_version(self) -> int:
        """The oldest weights that produced any of its tokens (what a staleness bound counts from)."""
        return min(self.weight_versions)

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def to_generated_sample(self) -> GeneratedSample:
        """The row as the trainer's sample format (``data.collate.collate_samples`` builds the ``[B, S]`` batch)."""
        return GeneratedSample(
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            response_logprobs=list(self.response_logprobs),
            truncated=self.truncated,
            weight_version=self.weight_version,
            final_weight_version=self.final_weight_version,
            response_mask=list(self.response_mask),
            num_turns=len(self.calls),
            decoded_tokens=self.decoded_tokens if self.decoded_tokens != sum(self.response_mask) else None,
        )


@dataclass
class _Chain:
    """A row being built: its ids so far, the per-token mask and logprobs after ``prompt_len``."""

    ids: list[int]
    prompt_len: int
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    final_version: int = 0
    calls: list[tuple[int, int]] = field(default_factory=list)
    truncated: bool = False
    decoded_tokens: int = 0

    def extended_by(self, prompt: Sequence[int]) -> bool:
        n = len(self.ids)
        return len(prompt) >= n and list(prompt[:n]) == self.ids

    def append(self, call: CallRecord) -> None:
        observation = list(call.prompt_ids[len(self.ids) :])
        self.ids += observation + list(call.completion_ids)
        self.mask += [0] * len(observation) + [1] * len(call.completion_ids)
        self.logprobs += [0.0] * len(observation) + list(call.logprobs)
        self.versions.append(call.weight_version)
        self.final_version = call.final_weight_version
        self.calls.append((call.call_index, call.choice_index))
        self.truncated = call.truncated
        self.decoded_tokens += call.num_decoded_tokens


def build_rows(session_id: str, calls: Sequence[CallRecord], reward: float) -> list[TrainingRow]:
    """The session's rows under the module's rules (no checks: see :func:`session_rows`)."""
    chains: list[_Chain] = []
    for call in calls:
        extendable = [c for c in chains if c.extended_by(call.prompt_ids)]
        chain = max(extendable, key=lambda c: len(c.ids)) if extendable else None
        if chain is None:
            chain = _Chain(ids=list(call.prompt_ids), prompt_len=len(call.prompt_ids))
            chains.append(chain)
        chain.append(call)
    return [
        TrainingRow(
            session_id=session_id,
            prompt_ids=c.ids[: c.prompt_len],
            response_ids=c.ids[c.prompt_len :],
            response_mask=c.mask,
            response_logprobs=c.logprobs,
            reward=reward,
            weight_versions=c.versions,
            final_weight_version=c.final_version,
            calls=c.calls,
            branch=i,
            truncated=c.truncated,
            decoded_tokens=c.decoded_tokens,
        )
        for i, c in enumerate(chains)
    ]


def record_problems(calls: Sequence[CallRecord], vocab_size: int | None = None) -> list[str]:
    """What is wrong with the records (empty when they can be trained on): a logprob per sampled id, finite
    logprobs <= 0, ids in the vocabulary."""
    problems = []
    for call in calls:
        where = f"call {call.call_index} choice {call.choice_index}"
        if not call.completion_ids:
            problems.append(f"{where}: no sampled ids")
        if len(call.logprobs) != len(call.completion_ids):
            problems.append(f"{where}: {len(call.completion_ids)} sampled ids but {len(call.logprobs)} logprobs")
        if any(not math.isfinite(lp) or lp > 1e-6 for lp in call.logprobs):
            problems.append(f"{where}: a logprob is not finite or above 0")
        ids = call.prompt_ids + call.completion_ids
        if any(not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size) for t in ids):
            problems.append(f"{where}: a token id outside the vocabulary")
    return problems


def unsampled_positions(input_ids: Sequence[int], token_mask: Sequence[int], calls: Sequence[CallRecord]) -> list[int]:
    """Positions ``i`` of ``input_ids`` that ``token_mask`` marks for training although no call sampled token
    ``input_ids[i]`` after exactly ``input_ids[:i]`` (``token_mask`` is aligned with ``input_ids``)."""
    sampled = [False] * len(input_ids)
    for call in calls:
        full = call.full_ids
        p = len(call.prompt_ids)
        if len(input_ids) <= p or tuple(input_ids[:p]) != call.prompt_ids:
            continue
        for i in range(p, min(len(full), len(input_ids))):
            if input_ids[i] != full[i]:
                break
            sampled[i] = True
    return [i for i, m in enumerate(token_mask) if m and not sampled[i]]


def row_problems(row: TrainingRow, calls: Sequence[CallRecord]) -> list[str]:
    """What is wrong with a built row: a masked-in token nobody sampled there, or a logprob differing from the record."""
    mask = [0] * len(row.prompt_ids) + list(row.response_mask)
    bad = unsampled_positions(row.input_ids, mask, calls)
    problems = [f"row {row.branch}: masked-in positions {bad[:5]} were not sampled in that context"] if bad else []
    by_call = {(c.call_index, c.choice_index): c for c in calls}
    recorded = [lp for key in row.calls for lp in by_call[key].logprobs]
    trained = [lp for lp, m in zip(row.response_logprobs, row.response_mask) if m]
    if recorded != trained:
        problems.append(f"row {row.branch}: its logprobs differ from the recorded ones")
    return problems


@dataclass
class SessionRows:
    """A finished session: its rows (empty when rejected), its recorded HTTP calls (``num_calls``: the answered ones, a
    call with ``n`` choices one; refused and abandoned calls are counted apart), why it was rejected, if it was, how
    many of its calls the server refused for its token budget, and how many it cancelled because their client left
    before the answer (``abandoned_calls``: in no row)."""

    session_id: str
    reward: float
    rows: list[TrainingRow]
    num_calls: int
    rejected: str | None = None
    budget_refusals: int = 0
    abandoned_calls: int = 0
    decoded_tokens: int = 0  # tokens the engine decoded for its recorded calls, a rejected session's too

    @property
    def branched(self) -> bool:
        return len(self.rows) > 1

    @property
    def weight_version(self) -> int | None:
        """The weight version of the session's first call (None: no rows), what every row's age counts from: versions
        only grow, so it is also the oldest weights that produced any of its tokens (a branched session's later rows
        start at later calls)."""
        return min((row.weight_version for row in self.rows), default=None)


def session_rows(session_id: str, calls: Sequence[CallRecord], reward: float, vocab_size: int | None = None) -> SessionRows:
    """The checked rows of a session: rejected (no rows) when it has no calls, when its records are inconsistent
    (:func:`record_problems`), or when a built row fails :func:`row_problems`; every sampled token is masked in once."""
    if not calls:
        return SessionRows(session_id, reward, [], 0, rejected="the session recorded no calls")
    num_calls, decoded = len({c.call_index for c in calls}), sum(c.num_decoded_tokens for c in calls)
    problems = record_problems(calls, vocab_size)
    rows = [] if problems else build_rows(session_id, calls, reward)
    for row in rows:
        problems += row_problems(row, calls)
    if not problems and sum(sum(r.response_mask) for r in rows) != sum(len(c.completion_ids) for c in calls):
        problems.append("the rows do not mask in every sampled token exactly once")
    if problems:
        return SessionRows(session_id, reward, [], num_calls, rejected="; ".join(problems), decoded_tokens=decoded)
    return SessionRows(session_id, reward, rows, num_calls, decoded_tokens=decoded)


@dataclass
class RowBatch:
    """Ended sessions flattened for the trainer: one sample per row, each row's reward (its session's) and the index
    of its session in ``sessions``. Rejected sessions contribute no row. Compute advantages per session (a branched
    session must not weigh more in its group's baseline) and give every row its session's: ``session_of_row``."""

    samples: list[GeneratedSample]
    rewards: list[float]
    session_of_row: list[int]
    sessions: list[SessionRows]


def rows_for_training(results: Sequence[SessionRows]) -> RowBatch:
    """The rows of ``results`` as :class:`GeneratedSample` s (``data.collate.collate_samples`` makes the batch), each
    with its session's :attr:`~SessionRows.weight_version` (a branched session's later rows included) and its number of
    calls as ``num_turns``, as a training run's agent rollouts give them."""
    batch = RowBatch([], [], [], list(results))
    for index, result in enumerate(results):
        version = result.weight_version
        for row in result.rows:
            batch.samples.append(replace(row.to_generated_sample(), weight_version=version))
            batch.rewards.append(row.reward)
            batch.session_of_row.append(index)
    return batch
