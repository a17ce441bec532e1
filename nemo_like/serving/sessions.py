"""Sessions: one agent rollout's calls, recorded as the engine sampled them, and turned into rows when it ends.

A session is opened by the run (:meth:`SessionStore.open`) or, with ``auto_create``, by its first call. Each call
appends :class:`~.trajectory.CallRecord` s and feeds the session's :class:`~.continuation.Continuations` (so the
next call reuses the ids already sampled). :meth:`SessionStore.end` builds the rows (:func:`~.trajectory.session_rows`)
once; the result stays available to :meth:`SessionStore.take_result` / :meth:`SessionStore.take_finished`.
Thread-safe: the HTTP handlers and the training loop call it from different threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import struct
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_like.serving.continuation import Continuations
from nemo_like.serving.errors import ServingError, bad_request, session_ended, session_not_found, session_reward_conflict
from nemo_like.serving.trajectory import CallRecord, SessionRows, session_rows
from nemo_like.utils.seeds import agent_call_seed

#: Session metadata the run sets when it opens a session: every call's sampling seed derives from ``SEED_KEY``, the
#: call's prompt ids and its sampling settings (:meth:`SessionStore.call_seed`, :func:`~nemo_like.utils.seeds.agent_call_seed`); the session
#: samples at most ``BUDGET_KEY`` tokens (its calls reserve theirs, :meth:`SessionStore.reserve`); with ``GREEDY_KEY``
#: true its calls decode greedily (validation and eval with ``grpo.val_greedy`` / ``eval.greedy``).
SEED_KEY = "seed"
BUDGET_KEY = "token_budget"
GREEDY_KEY = "greedy"
#: Ended session ids remembered (so a late call to one is a 409, not a new session); the oldest are forgotten past it.
MAX_ENDED_IDS = 100_000


@dataclass
class Session:
    """A session's state while it runs."""

    session_id: str
    metadata: dict[str, Any] = field(default_factory=dict)
    calls: list[CallRecord] = field(default_factory=list)
    continuations: Continuations = field(default_factory=Continuations)
    num_http_calls: int = 0
    ended: bool = False
    reserved_tokens: int = 0  # tokens the calls in flight may still sample (their budget reservations)
    budget_refusals: int = 0  # calls refused because the budget had too few tokens left
    abandoned_calls: int = 0  # calls cancelled because their client left before the answer (not recorded)
    calls_in_flight: int = 0  # HTTP calls begun and not yet answered (SessionStore.begin_call / end_call)
    prompt_calls: dict[bytes, int] = field(default_factory=dict)  # seeded calls so far per prompt and settings (digest)

    @property
    def sampled_tokens(self) -> int:
        """Tokens sampled in this session so far (every call, every choice)."""
        return sum(len(c.completion_ids) for c in self.calls)


def check_session_settings(metadata: dict[str, Any] | None) -> None:
    """The metadata keys the server reads (``SEED_KEY``, ``BUDGET_KEY``) must be non-negative integers when set
    (``{"seed": "experiment-7"}`` made every call of the session a 500).

    Raises:
        ServingError: 400 naming ``metadata.<key>``."""
    greedy = (metadata or {}).get(GREEDY_KEY)
    if greedy is not None and not isinstance(greedy, bool):
        raise bad_request(f"metadata.{GREEDY_KEY} must be true or false, got {greedy!r}", param=f"metadata.{GREEDY_KEY}")
    for key in (SEED_KEY, BUDGET_KEY):
        value = (metadata or {}).get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise bad_request(
                f"metadata.{key} must be a non-negative integer (the server reads it: see the session endpoints), got {value!r}",
                param=f"metadata.{key}",
            )


def call_settings(params: Any, n: int = 1) -> str:
    """A call's sampling settings as :meth:`SessionStore.call_seed` keys them: its ``SamplingParams`` as asked (before
    the session budget's cut of ``max_new_tokens``, which depends on what the session's other calls reserved) and its
    number of choices ``n``."""
    return f"{params!r}/n={n}"


def prompt_digest(prompt_ids: Sequence[int]) -> bytes:
    """A digest of a call's prompt ids (the key :meth:`SessionStore.call_seed` counts a session's calls by)."""
    return hashlib.sha256(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids)).digest()


@dataclass
class SessionCounters:
    """Totals since the store started (``agent/*`` metrics)."""

    sessions: int = 0
    sessions_with_rows: int = 0
    calls: int = 0
    rows: int = 0
    branched: int = 0
    rejected: int = 0
    abandoned_calls: int = 0

    def as_metrics(self) -> dict[str, float]:
        """``agent/*`` numbers over the ended sessions."""
        n = max(self.sessions, 1)
        return {
            "agent/sessions": float(self.sessions),
            "agent/branched_sessions": float(self.branched),
            "agent/rejected_sessions": float(self.rejected),
            "agent/rows_per_session": self.rows / max(self.sessions_with_rows, 1),  # of the sessions with rows
            "agent/calls_per_session": self.calls / n,
            "agent/abandoned_calls": float(self.abandoned_calls),
        }


@dataclass
class _PendingEnd:
    """An end in progress: set ``done`` once its rows are built (``result``; ``None`` if building them failed)."""

    done: threading.Event = field(default_factory=threading.Event)
    result: SessionRows | None = None


class SessionStore:
    """Open sessions by id, and the results of ended ones until they are taken."""

    def __init__(
        self,
        auto_create: bool = True,
        vocab_size: int | None = None,
        on_end: Callable[[str], None] | None = None,
        max_kept_results: int | None = None,
    ) -> None:
        self.auto_create = auto_create
        self.vocab_size = vocab_size
        self.on_end = on_end  # told each session id once it ends (the generation queue stops waiting for its calls)
        # None: every result is kept until taken (a training run takes them); a server that nobody takes results from
        # (``nemo-like serve``) keeps the newest this many, so a repeated end of an older session gets a 409, and as many
        # open sessions, opened by their first call or by :meth:`open`: one more ends the least recently used (agents
        # that never end theirs grew it forever).
        self.max_kept_results = max_kept_results
        self._lock = threading.Lock()
        self._open: dict[str, Session] = {}
        self._ended: dict[str, None] = {}  # insertion-ordered: the oldest are forgotten past MAX_ENDED_IDS
        self._results: dict[str, SessionRows] = {}
        self._building: dict[str, _PendingEnd] = {}  # ended sessions whose rows are being built
        self._end_rewards: dict[str, float | None] = {}  # the reward each ended session's first end gave (None: omitted)
        self._to_end: dict[str, None] = {}  # open sessions chosen to end for room, not ended yet (:meth:`make_room`)
        self.counters = SessionCounters()

    def open(self, session_id: str | None = None, metadata: dict[str, Any] | None = None, make_room: bool = True) -> str:
        """Start a session (a fresh random id when ``session_id`` is None) and return its id. Past
        ``max_kept_results`` open sessions it ends the least recently used idle ones, as a session its first call
        opens does (:meth:`_touch`); ``make_room=False``: chooses them only, for :meth:`make_room` (the server calls it
        off its event loop: ending a session builds its rows)."""
        check_session_settings(metadata)
        session_id = session_id or uuid.uuid4().hex
        with self._lock:
            if session_id in self._open or session_id in self._ended:
                raise ValueError(f"session {session_id!r} already exists")
            self._choose_unused()
            self._open[session_id] = Session(session_id, dict(metadata or {}))
        if make_room:
            self.make_room()
        return session_id

    def session(self, session_id: str, make_room: bool = True) -> Session:
        """The open session ``session_id`` (created if unknown and ``auto_create``; ``make_room``: as in :meth:`open`).

        Raises:
            ServingError: 404 for an unknown id (without ``auto_create``), 409 for an ended one."""
        session = self._touch(session_id, begin_call=False)
        if make_room:
            self.make_room()
        return session

    def begin_call(self, session_id: str, make_room: bool = True) -> tuple[Session, int]:
        """The session and the index of the call about to be made in it; the call is in flight (never ended for the
        store's room, :meth:`_touch`) until :meth:`end_call`. ``make_room``: as in :meth:`open`."""
        session = self._touch(session_id, begin_call=True)
        if make_room:
            self.make_room()
        return session, session.num_http_calls - 1

    @property
    def room_pending(self) -> bool:
        """Whether sessions were chosen to end for room and :meth:`make_room` has not ended them yet."""
        return bool(self._to_end)

    def make_room(self) -> None:
        """End the sessions chosen to end for the store's room (:meth:`_touch`, :meth:`open`), each unless a call began
        in it meanwhile (or it ended). This builds their rows: the server runs it off its event loop, where a long
        session's rows stalled every other request."""
        while True:
            with self._lock:  # one at a time: a session used while an earlier one ends leaves the list (_touch)
                if not self._to_end:
                    return
                session_id = next(iter(self._to_end))
                del self._to_end[session_id]
            with contextlib.suppress(ServingError):  # ended meanwhile
                self.end(session_id, if_idle=True)

    def end_call(self, session: Session) -> None:
        """The call :meth:`begin_call` began has ended (answered, refused or failed)."""
        with self._lock:
            session.calls_in_flight -= 1

    def _touch(self, session_id: str, begin_call: bool) -> Session:
        """The open session (created if unknown and ``auto_create``, :meth:`_choose_unused` then choosing sessions to
        end for its room) made the most recently used, a call begun in it when ``begin_call``."""
        with self._lock:
            if session_id in self._ended:
                raise session_ended(session_id)
            found = self._open.pop(session_id, None)
            if found is None:
                if not self.auto_create:
                    raise session_not_found(session_id)
                found = Session(session_id)
                self._choose_unused()
            self._to_end.pop(session_id, None)  # used again: no longer the least recently used
            self._open[session_id] = found  # the most recently used last
            if begin_call:
                found.num_http_calls += 1
                found.calls_in_flight += 1
            return found

    def _choose_unused(self) -> None:
        """Before one more session opens (under the lock): while more than ``max_kept_results`` sessions would be open,
        choose the least recently used ones without a call in flight to end (:meth:`make_room`; busy ones are left: the
        next new session ends them). Those chosen already count as gone."""
        if self.max_kept_results is None:
            return
        over = len(self._open) - sum(sid in self._open for sid in self._to_end) + 1 - self.max_kept_results
        if over > 0:
            idle = (sid for sid, s in self._open.items() if not s.calls_in_flight and sid not in self._to_end)
            self._to_end.update(dict.fromkeys(itertools.islice(idle, over)))

    def call_seed(self, session: Session, prompt_ids: Sequence[int], settings: str = "") -> int | None:
        """The sampling seed of a call of ``session`` about to sample ``prompt_ids`` with ``settings`` (the sampling
        parameters, as text) (``None``: the session has no ``SEED_KEY``): :func:`~nemo_like.utils.seeds.agent_call_seed`
        of the session's seed, the prompt and how many earlier calls of the session had the same prompt ids and
        settings. Not the call's place in arrival order: a deterministic agent's concurrent calls (``asyncio.gather``)
        reach the server in any order, and each must sample the same on a rerun; calls with identical prompts and
        settings are interchangeable, so their own order does not matter. (A call that never sampled, its client gone
        before the engine took it, still counts: its retry is the next repeat.)"""
        base = session.metadata.get(SEED_KEY)
        if base is None:
            return None
        key = hashlib.sha256(prompt_digest(prompt_ids) + settings.encode()).digest()
        with self._lock:
            repeat = session.prompt_calls.get(key, 0)
            session.prompt_calls[key] = repeat + 1
        return agent_call_seed(int(base), prompt_ids, repeat, settings)

    def reserve(self, session: Session, max_new_tokens: int, n: int) -> tuple[int, int]:
        """Reserve a call's tokens in the session's budget (``BUDGET_KEY``; none: nothing to reserve): each of its ``n``
        choices may sample ``max_new_tokens``, or as many as the budget has left for each after the sampled tokens and
        the reservations of the calls in flight. Returns (the tokens each choice may sample, the tokens reserved:
        :meth:`release` them once the call is recorded or failed).

        Raises:
            ServingError: 400 ``session_budget_exceeded`` when fewer than ``n`` tokens are left."""
        with self._lock:
            budget = session.metadata.get(BUDGET_KEY)
            if budget is None:
                return max_new_tokens, 0
            left = int(budget) - session.sampled_tokens - session.reserved_tokens
            if left < n:
                session.budget_refusals += 1
                in_flight = f", {session.reserved_tokens} more reserved by its calls in flight" if session.reserved_tokens else ""
                raise bad_request(
                    f"This session has sampled {session.sampled_tokens} tokens{in_flight}; its budget is {int(budget)}, so "
                    f"{max(left, 0)} are left, fewer than one per choice ('n'={n}).",
                    param="n" if left > 0 else "max_tokens",
                    code="session_budget_exceeded",
                )
            per_choice = min(max_new_tokens, left // n)
            session.reserved_tokens += per_choice * n
            return per_choice, per_choice * n

    def release(self, session: Session, tokens: int) -> None:
        """Give back a call's reservation (:meth:`reserve`): its sampled tokens are recorded, or it failed."""
        with self._lock:
            session.reserved_tokens -= tokens

    def abandon(self, session: Session) -> None:
        """Count a call of ``session`` cancelled because its client left before the answer (nothing was recorded)."""
        with self._lock:
            session.abandoned_calls += 1

    def record(self, session: Session, records: Sequence[CallRecord], texts: Sequence[tuple[str, str]]) -> None:
        """Append one HTTP call's records; ``texts[i]`` = (prompt text, completion text) of ``records[i]``.

        Raises:
            ServingError: 409 when the session ended while the call was running (the records are dropped)."""
        with self._lock:
            if session.ended:
                raise session_ended(session.session_id)
            for record, (prompt_text, completion_text) in zip(records, texts):
                session.calls.append(record)
                session.continuations.add(prompt_text + completion_text, record.full_ids)

    def end(self, session_id: str, reward: float | None = None, if_idle: bool = False) -> SessionRows | None:
        """End the session and build its rows (reward 0.0 when None); a second end returns the same result, also one
        that arrives while the first is still building the rows (the agent's own end racing the run's). A first end
        that gave no reward (an agent saying it is done) leaves the reward to a later end that gives one (a harness
        around the server that scores the episode): that end sets it on the result and its rows. ``if_idle``: only an
        open session without a call in flight (else None: the store's own ending, for room).

        Raises:
            ServingError: 404 for an unknown id, 409 for one whose result was already taken."""
        with self._lock:
            if session_id in self._results or session_id in self._building:
                self._check_same_reward(session_id, reward)
                if reward is not None and self._end_rewards.get(session_id) is None:
                    self._end_rewards[session_id] = float(reward)
            if session_id in self._results:
                return self._with_end_reward(self._results[session_id])
            pending = self._building.get(session_id)
            if pending is None:
                if session_id in self._ended:
                    raise session_ended(session_id)
                if if_idle:
                    candidate = self._open.get(session_id)
                    if candidate is None or candidate.calls_in_flight:
                        return None
                session = self._open.pop(session_id, None)
                if session is None:
                    raise session_not_found(session_id)
                session.ended = True
                self._remember_ended(session_id)
                self._end_rewards[session_id] = None if reward is None else float(reward)
                calls = sorted(session.calls, key=lambda c: (c.call_index, c.choice_index))
                refusals, abandoned = session.budget_refusals, session.abandoned_calls
                building = self._building[session_id] = _PendingEnd()
        if pending is not None:  # another caller is building the rows: its result is this call's too
            pending.done.wait()
            if pending.result is None:
                raise session_ended(session_id)
            return pending.result  # with this end's reward: given while the rows were built, the builder applied it
        try:
            if self.on_end is not None:
                self.on_end(session_id)
            result = session_rows(session_id, calls, 0.0 if reward is None else float(reward), self.vocab_size)
            result.budget_refusals, result.abandoned_calls = refusals, abandoned
            with self._lock:
                self._with_end_reward(result)  # an end that gave the reward while these rows were built
                self._count(result)
                self._results[session_id] = result
                # no longer building, in the same hold of the lock: a later end finds the result (or, once it is taken,
                # a 409), never a pending build whose result was taken meanwhile
                self._building.pop(session_id, None)
                building.result = result
                if self.max_kept_results is not None:
                    while len(self._results) > self.max_kept_results:
                        self._forget_result(next(iter(self._results)))
            return result
        finally:
            with self._lock:
                self._building.pop(session_id, None)
                if building.result is None:  # the rows failed: no result will ever drop its first end's reward
                    self._end_rewards.pop(session_id, None)
            building.done.set()

    def _check_same_reward(self, session_id: str, reward: float | None) -> None:
        """A repeated end (under the lock) must not contradict the first: two explicit, different rewards are a 409 (the
        second had been answered with the first's rows and reward, and silently dropped)."""
        first = self._end_rewards.get(session_id)
        if reward is not None and first is not None and float(reward) != first:
            raise session_reward_conflict(session_id, first, float(reward))

    def _with_end_reward(self, result: SessionRows) -> SessionRows:
        """``result`` with the reward its session's ends gave (under the lock): a first end without one built its rows
        with 0.0, and a later end that gave one sets it (it was dropped: the rows kept 0.0)."""
        reward = self._end_rewards.get(result.session_id)
        if reward is not None and result.reward != reward:
            result.reward = reward
            for row in result.rows:
                row.reward = reward
        return result

    def _count(self, result: SessionRows) -> None:
        c = self.counters
        c.sessions += 1
        c.sessions_with_rows += int(bool(result.rows))
        c.calls += result.num_calls
        c.rows += len(result.rows)
        c.branched += int(result.branched)
        c.rejected += int(result.rejected is not None)
        c.abandoned_calls += result.abandoned_calls

    def _remember_ended(self, session_id: str) -> None:
        """Record ``session_id`` as ended (under the lock), forgetting the oldest past :data:`MAX_ENDED_IDS`."""
        self._ended[session_id] = None
        while len(self._ended) > MAX_ENDED_IDS:
            self._ended.pop(next(iter(self._ended)))

    def _forget_result(self, session_id: str) -> SessionRows | None:
        """Drop an ended session's result and its first end's reward (under the lock); returns the result."""
        self._end_rewards.pop(session_id, None)
        return self._results.pop(session_id, None)

    def take_result(self, session_id: str) -> SessionRows | None:
        """The ended session's result, removed from the store (None if it has not ended or was taken)."""
        with self._lock:
            return self._forget_result(session_id)

    def take_finished(self) -> list[SessionRows]:
        """Every ended session's result not taken yet, in the order they ended."""
        with self._lock:
            return [result for result in (self._forget_result(sid) for sid in list(self._results)) if result is not None]

    def open_ids(self) -> list[str]:
        """The ids of the sessions still running."""
        with self._lock:
            return list(self._open)

    def metrics(self) -> dict[str, float]:
        """``agent/sessions``, ``agent/branched_sessions``, ``agent/rejected_sessions``, ``agent/rows_per_session``,
        ``agent/calls_per_session``, ``agent/abandoned_calls`` since the store started."""
        with self._lock:
            return self.counters.as_metrics()
