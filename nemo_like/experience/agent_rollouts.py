"""Agent tasks (``env.<task>: {class: agent, ...}``): each sample is one session of the user's agent against the run's
rollout server, and the session's rows become the step's samples.

Per batch (:meth:`AgentRollouts.collect`): every sample opens a session (seeded from the batch's seed and its index,
:func:`~nemo_like.utils.seeds.agent_session_seed`, with the task's token budget), the agent function runs with
``(base_url, api_key, session_id, prompt messages, metadata)`` (at most ``max_concurrency`` at once, each within
``deadline_s``), the session ends as soon as the function returns (a late call is refused), and what it returned is
its reward or the messages the task's verifier scores (the agent environment's actors). A session that raised, ran
past its deadline, sampled over its budget, returned something else, or whose records failed the server's checks
fails: its rows (or, with none, one placeholder row with nothing masked in) get ``failure_reward`` and it is counted
in ``agent/failures/<kind>``; the run continues. The server is :class:`nemo_like.serving.server.RolloutServer` (the
layer just below this one), started by :func:`start_agent_rollouts`, over an :class:`EngineGate`.

Async runs (``docs/guides/async-grpo.md``): the trajectory collector runs :meth:`AgentRollouts.collect` on a driver
thread ahead of training, and a refit may land between two of a session's calls, never inside an engine call (the
:class:`EngineGate`). Every row of a session carries the weight version of the session's first call (its oldest), so
its age, the staleness bound and the replay buffer's check count from there (:func:`session_samples`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import numbers
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from nemo_like.data.prompts import PromptRecord
from nemo_like.environments.agent import FAILURE_KINDS, AgentSettings, final_answer, load_agent_settings
from nemo_like.environments.registry import EnvSpec, task_of
from nemo_like.environments.worker import EnvironmentHandles
from nemo_like.experience.env_calls import call_environments
from nemo_like.experience.rollouts import Rollout, expand_groups
from nemo_like.models.generation.interface import GeneratedSample
from nemo_like.models.loading import model_vocab_size
from nemo_like.serving.server import RolloutServer, ServerConfig
from nemo_like.serving.service import run_sampling
from nemo_like.serving.sessions import BUDGET_KEY, GREEDY_KEY, SEED_KEY
from nemo_like.utils.seeds import agent_session_seed
from nemo_like.utils.stop_signals import call_handling_signals, wait_for_handling_signals, wake_for_signals

AGENT_THREAD = "agent-session"  # the name of a sync agent's thread (abandoned past its deadline; joined briefly at close)


@dataclass
class SessionOutcome:
    """What one session's agent did: a reward, an answer to verify, or a failure kind."""

    reward: float | None = None
    answer: str | None = None
    failure: str | None = None
    detail: str = ""


def reward_number(value: Any) -> float | None:
    """``value`` as a reward if it is a real number: any :class:`numbers.Real` (``numpy.float32``, ``Fraction``, ...)
    or a 0-d numpy array or torch tensor of an integer or floating dtype, as ``float``; ``None`` for anything else
    (a bool is not a reward, nor a tensor of more than one element)."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, torch.Tensor):
        numeric = value.dtype.is_floating_point or not (value.dtype.is_complex or value.dtype == torch.bool)
        return float(value) if value.ndim == 0 and numeric else None
    if isinstance(value, np.ndarray):
        return float(value) if value.ndim == 0 and value.dtype.kind in "iuf" else None
    if not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # an int or Fraction past a float's range: not finite, a bad return (not the agent's error)
        return math.inf if value > 0 else -math.inf


def outcome_of(value: Any, has_verifier: bool) -> SessionOutcome:
    """Interpret an agent's return value: a finite real number (:func:`reward_number`) is the reward; a string or
    messages are verified."""
    reward = reward_number(value)
    if reward is not None:
        if not math.isfinite(reward):
            return SessionOutcome(failure="bad_return", detail=f"the reward {value!r} is not finite")
        return SessionOutcome(reward=reward)
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return SessionOutcome(
            failure="bad_return",
            detail=f"a reward must be one real number; got a {type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}",
        )
    try:
        answer = final_answer(value)
    except TypeError as exc:
        return SessionOutcome(failure="bad_return", detail=str(exc))
    if not has_verifier:
        return SessionOutcome(failure="bad_return", detail="the agent returned messages but env.<task>.verifier is not set")
    return SessionOutcome(answer=answer)


def _in_thread(fn: Callable[..., Any], args: tuple, threads: set[threading.Thread] | None = None) -> asyncio.Future:
    """Run a sync agent on its own daemon thread (one that hangs past its deadline is abandoned, not joined);
    ``threads``: where the thread is kept while it runs (:meth:`AgentRollouts.close` joins them briefly)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def run() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - the agent's failure is the session's
            value, error = None, exc
        finally:
            if threads is not None:
                threads.discard(threading.current_thread())
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the batch is over (its loop closed): a late agent's result is dropped
            pass

    thread = threading.Thread(target=run, name=AGENT_THREAD, daemon=True)
    if threads is not None:
        threads.add(thread)
    thread.start()
    return future


async def run_session(
    settings: AgentSettings,
    args: tuple,
    semaphore: asyncio.Semaphore,
    end: Callable[[], None],
    threads: set[threading.Thread] | None = None,
    start: Callable[[], None] | None = None,
) -> SessionOutcome:
    """Call the agent within its deadline; ``start`` runs just before it (its calls are on their way), ``end`` (ending
    the session) as soon as it returns or fails. ``threads``: where a sync agent's thread is kept while it runs."""
    cfg = settings.config
    async with semaphore:
        if start is not None:
            start()
        deadline = asyncio.timeout(cfg.deadline_s)
        try:
            async with deadline:
                value = await (settings.function(*args) if settings.is_async else _in_thread(settings.function, args, threads))
                if inspect.isawaitable(value):  # a plain function that returns a coroutine (a hand-written wrapper)
                    value = await value
            outcome = outcome_of(value, cfg.verifier is not None)
        except TimeoutError as exc:
            if deadline.expired():
                outcome = SessionOutcome(failure="deadline", detail=f"still running after deadline_s={cfg.deadline_s}")
            else:  # the agent's own timeout (an HTTP read, say), raised before the deadline: an error of its own
                outcome = SessionOutcome(failure="error", detail=f"{type(exc).__name__}: {exc}")
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - any error of user code (sys.exit too) fails only its session
            outcome = SessionOutcome(failure="error", detail=f"{type(exc).__name__}: {exc}")
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # this batch was cancelled (the run is stopping): not the agent's
                raise
            # the agent's own (a sub-task it cancelled and awaited, a leaked cancel scope): an error of its session
            outcome = SessionOutcome(failure="error", detail=f"CancelledError: {exc}")
        finally:
            end()
    return outcome


def report_failures(failures: dict[str, float], causes: dict[str, str], num_sessions: int) -> None:
    """One stderr line per batch with failed sessions: each kind's count and the first session's cause, so a bug in
    the agent is visible without reading the metrics (the run goes on; the counts are in ``agent/failures/<kind>``)."""
    parts = [f"{kind} x{int(n)} (first: {causes[kind]})" for kind, n in failures.items() if n]
    if parts:
        print(f"[agent] {int(sum(failures.values()))} of {num_sessions} sessions failed: " + "; ".join(parts), file=sys.stderr, flush=True)


def placeholder_row(prompt: PromptRecord, pad_token_id: int, weight_version: int, decoded_tokens: int = 0) -> GeneratedSample:
    """The row of a failed session without rows: its prompt and one pad token, nothing masked in (it counts in its
    group's baseline with ``failure_reward``, and trains no token); ``decoded_tokens``: what the engine decoded for the
    session's calls all the same (``performance/num_generated_tokens`` counts them)."""
    return GeneratedSample(
        list(prompt.prompt_token_ids), [pad_token_id], [0.0], False, weight_version, weight_version, response_mask=[0],
        decoded_tokens=decoded_tokens,
    )  # fmt: skip


def session_version(result: Any) -> int | None:
    """The weight version of a session's first call (``None``: it made none): what its age counts from
    (:attr:`SessionRows.weight_version <nemo_like.serving.trajectory.SessionRows.weight_version>`, which
    ``rows_for_training`` gives every row too)."""
    return result.weight_version if result is not None else None


def session_samples(result: Any, open_version: int) -> list[GeneratedSample]:
    """A session's rows as samples, every one carrying the session's version (:func:`session_version`; a session
    without rows: ``open_version``, the engine's when it opened), so a session whose calls span a refit is counted
    from its first call, and ``final_weight_version`` (its last call's) marks it as spanning versions."""
    rows = result.rows if result is not None else []
    version = session_version(result)
    return [
        replace(r.to_generated_sample(), num_turns=len(r.calls), weight_version=open_version if version is None else version) for r in rows
    ]


def per_session(session_of_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows -> sessions for advantages: the first row of each session (index the per-row rewards, groups and sample
    mask with it to get one entry per session) and each row's session (index the sessions' advantages with it), so a
    branched session weighs once in its group's baseline and every one of its rows takes its advantage."""
    _, row_index = torch.unique(session_of_row, return_inverse=True)
    rows = torch.arange(len(row_index))
    first = torch.full((int(row_index.max()) + 1 if len(rows) else 0,), len(rows), dtype=torch.long)
    return first.scatter_reduce_(0, row_index, rows, reduce="amin"), row_index


@dataclass
class _Session:
    index: int
    session_id: str
    prompt: PromptRecord
    settings: AgentSettings
    open_version: int = 0  # the engine's weight version when the session opened (a row-less session's version)
    outcome: SessionOutcome | None = None
    result: Any = None  # SessionRows
    ended: bool = False


class AgentRollouts:
    """The driver side of agent tasks: runs sessions against ``server`` and turns them into a :class:`Rollout`."""

    def __init__(self, server: RolloutServer, settings: dict[str, AgentSettings], tokenizer: Any, engine: Any) -> None:
        self.server = server
        self.settings = settings
        self.tokenizer = tokenizer
        self.engine = engine  # the generation engine the server samples with (its weight version)
        self._lock = threading.Lock()
        self._running: set[tuple[asyncio.AbstractEventLoop, asyncio.Task]] = set()  # batches in flight (cancel())
        self._threads: set[threading.Thread] = set()  # sync agents' threads still running (close())
        self._closed = False

    def serves(self, prompts: list[PromptRecord], tasks: list[str]) -> bool:
        """Whether the batch is an agent batch (every prompt of an agent run is of an agent task)."""
        return any(task_of(p.metadata, tasks) in self.settings for p in prompts)

    def _open(self, index: int, prompt: PromptRecord, task: str, seed: int, greedy: bool) -> _Session:
        settings = self.settings[task]
        meta: dict[str, Any] = {SEED_KEY: agent_session_seed(seed, index)} if settings.config.seeded_calls else {}
        meta[BUDGET_KEY] = settings.config.max_tokens_per_session
        if greedy:
            meta[GREEDY_KEY] = True
        version = int(self.engine.weight_version)
        return _Session(index, self.server.sessions.open(metadata=meta), prompt, settings, open_version=version)

    def _end(self, session: _Session) -> None:
        session.ended = True
        self.server.sessions.end(session.session_id)
        session.result = self.server.sessions.take_result(session.session_id)

    async def _run_all(self, sessions: list[_Session]) -> None:
        limits = {task: asyncio.Semaphore(s.config.max_concurrency) for task, s in self.settings.items()}
        url, key = self.server.base_url, self.server.api_key

        async def one(s: _Session) -> None:
            args = (url, key, s.session_id, [dict(m) for m in s.prompt.messages], dict(s.prompt.metadata))
            start, end = (lambda: self.server.expect_calls(s.session_id)), (lambda: self._end(s))
            s.outcome = await run_session(s.settings, args, limits[s.settings.task], end, self._threads, start)

        running = (asyncio.get_running_loop(), asyncio.current_task())
        with self._lock:
            if self._closed:
                raise AgentRolloutsClosed("the run is stopping: no new agent sessions")
            self._running.add(running)
        woken = asyncio.create_task(wake_for_signals()) if threading.current_thread() is threading.main_thread() else None
        try:
            await asyncio.gather(*(one(s) for s in sessions))
        finally:
            if woken is not None:
                woken.cancel()
            with self._lock:
                self._running.discard(running)
            for s in sessions:
                if not s.ended:  # cancelled while it waited for its agent's turn (max_concurrency): free its session
                    self._end(s)

    def cancel(self) -> None:
        """Stop every batch in flight and refuse new ones (the run is stopping): each running session is ended (its
        agent's next call gets 409, so a sync agent's thread returns), and :meth:`collect` raises
        :class:`AgentRolloutsClosed` in the thread that called it."""
        with self._lock:
            self._closed = True
            running = list(self._running)
        for loop, task in running:
            with contextlib.suppress(RuntimeError):  # its loop already closed: the batch is over
                loop.call_soon_threadsafe(task.cancel)

    def close(self, join_s: float = 2.0) -> int:
        """:meth:`cancel`, then give the sync agents' threads ``join_s`` seconds to return (they are daemon threads: one
        stuck in user code is left behind, and cannot call the server once it stops); returns how many are left."""
        self.cancel()
        deadline = time.monotonic() + join_s
        left = list(self._threads)
        for thread in left:
            thread.join(max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in left)

    def collect(
        self,
        envs: EnvironmentHandles,
        prompts: list[PromptRecord],
        num_generations: int,
        seed: int,
        timings: dict[str, float] | None = None,
        greedy: bool = False,
    ) -> Rollout:
        """``num_generations`` sessions per prompt; their rows as the batch (prompt-major, a session's rows adjacent).
        ``greedy`` (validation with ``grpo.val_greedy``, ``nemo-like eval`` with ``eval.greedy``): every call of the
        sessions decodes greedily (the server's ``greedy`` session metadata), whatever the run's temperature."""
        expanded, group_ids = expand_groups(prompts, num_generations)
        t0 = time.perf_counter()
        sessions = [self._open(i, p, task_of(p.metadata, envs.tasks), seed, greedy) for i, p in enumerate(expanded)]
        try:
            asyncio.run(self._run_all(sessions))
        except asyncio.CancelledError:
            raise AgentRolloutsClosed("the run is stopping: the agent batch in flight was cancelled") from None
        t1 = time.perf_counter()
        metrics = self._verify(envs, sessions)
        if timings is not None:
            timings["generation"], timings["reward"] = t1 - t0, time.perf_counter() - t1
        return self._rollout(sessions, group_ids, metrics)

    def _verify(self, envs: EnvironmentHandles, sessions: list[_Session]) -> dict[str, float]:
        """Score the answers of sessions that returned messages (the agent task's environment actors)."""
        todo = [s for s in sessions if s.outcome.answer is not None and s.outcome.failure is None]
        if not todo:
            return {}
        pending = call_environments(envs, "score", [s.outcome.answer for s in todo], [s.prompt.metadata for s in todo], "reward")
        rewards, counters = pending.gather()
        for s, reward in zip(todo, rewards):
            s.outcome.reward = float(reward)
        return counters

    def _classify(self, s: _Session) -> str | None:
        """The session's failure kind (None: it succeeded). The server never lets a session sample past its budget
        (its calls reserve their tokens): a session fails 'budget' when its agent raised after the server refused one
        of its calls for the budget."""
        if s.outcome.failure == "error" and s.result is not None and s.result.budget_refusals:
            return "budget"
        if s.outcome.failure is not None:
            return s.outcome.failure
        if s.result is None or s.result.rejected is not None:
            return "rejected"
        return None

    def _rollout(self, sessions: list[_Session], group_ids: torch.Tensor, metrics: dict[str, float]) -> Rollout:
        prompts, groups, samples, texts, rewards, owners = [], [], [], [], [], []
        session_row_count = 0  # rows built from the sessions' calls (a failed session's placeholder is not one)
        failures = dict.fromkeys(FAILURE_KINDS, 0.0)
        causes: dict[str, str] = {}
        for s in sessions:
            kind = self._classify(s)
            if kind is not None:
                failures[kind] += 1
                causes.setdefault(kind, self._cause(s, kind))
            reward = s.settings.config.failure_reward if kind is not None else s.outcome.reward
            rows = session_samples(s.result, s.open_version)
            session_row_count += len(rows)
            decoded = s.result.decoded_tokens if s.result is not None else 0
            for sample in rows or [placeholder_row(s.prompt, self.tokenizer.pad_token_id, s.open_version, decoded)]:
                prompts.append(s.prompt)
                groups.append(int(group_ids[s.index]))
                samples.append(sample)
                texts.append(s.outcome.answer if s.outcome.answer is not None else self._decode(sample))
                rewards.append(reward)
                owners.append(s.index)
        metrics.update(self._counters(sessions, failures, session_row_count))
        report_failures(failures, causes, len(sessions))
        return Rollout(
            prompts, torch.tensor(groups), samples, texts, torch.tensor(rewards, dtype=torch.float32), metrics,
            session_of_row=torch.tensor(owners),
        )  # fmt: skip

    @staticmethod
    def _cause(s: _Session, kind: str) -> str:
        """Why the session failed, in words (the first such session's cause goes in the batch's report)."""
        if kind == "rejected" and s.result is not None and s.result.rejected is not None:
            return str(s.result.rejected)
        if kind == "budget":
            budget = s.settings.config.max_tokens_per_session
            return f"a call was refused: the session had too few of its max_tokens_per_session={budget} tokens left ({s.outcome.detail})"
        return s.outcome.detail or "no result"

    def _decode(self, sample: GeneratedSample) -> str:
        return self.tokenizer.decode([t for t, m in zip(sample.response_ids, sample.sampled_mask) if m], skip_special_tokens=True)

    @staticmethod
    def _counters(sessions: list[_Session], failures: dict[str, float], num_rows: int) -> dict[str, float]:
        n = len(sessions)
        results = [s.result for s in sessions if s.result is not None]
        with_rows = sum(bool(r.rows) for r in results)
        out = {
            "agent/sessions": float(n),
            "agent/sessions_with_rows": float(with_rows),
            "agent/rows_per_session": num_rows / max(with_rows, 1),  # of the sessions with rows: 1.0 unless some branched
            "agent/branched_sessions": float(sum(r.branched for r in results)),
            "agent/rejected_sessions": float(sum(r.rejected is not None for r in results)),
            "agent/calls_per_session": sum(r.num_calls for r in results) / max(n, 1),
            "agent/abandoned_calls": float(sum(r.abandoned_calls for r in results)),
            "agent/failures": sum(failures.values()),
        }
        out.update({f"agent/failures/{kind}": count for kind, count in failures.items()})
        return out


class AgentRolloutsClosed(RuntimeError):
    """The run is stopping (:meth:`AgentRollouts.cancel`): no agent batch runs any more."""


class EngineGate:
    """The rollout server's engine, with refits kept out of its calls: the server's engine thread calls
    :meth:`generate`; the async loop's refit (not in flight) calls :meth:`hold`, which waits for the engine call in
    flight and holds the next ones until :meth:`release`. So every engine call samples with one weight version, and a
    refit lands between two calls of a session, never inside one (as the ordinary async path's refit waits for the
    batch in flight, :mod:`nemo_like.experience.trajectory_collector`). Without a hold (sync runs, validation) it
    only passes calls through; every other attribute is the engine's (``weight_version``, what the server's queue
    asks of it), so the server samples exactly as over the bare engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.cond = threading.Condition()
        self.calls = 0  # engine calls in flight
        self.held_since: float | None = None
        self.blocked_since: float | None = None  # when the first engine call started waiting at the held gate
        self.held_seconds = 0.0  # running total of release()'s: engine calls held by refits (inside generation batches)
        self.closed = False

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)

    def generate(self, *args: Any, **kwargs: Any) -> list[GeneratedSample]:
        """``engine.generate(prompts, params, seed)`` once no refit holds the gate."""
        with self.cond:
            if self.held_since is not None and self.blocked_since is None:
                self.blocked_since = time.perf_counter()
            self.cond.wait_for(lambda: self.held_since is None or self.closed)
            if self.closed:
                raise AgentRolloutsClosed("the run is stopping: the rollout server samples no more")
            self.calls += 1
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            with self.cond:
                self.calls -= 1
                self.cond.notify_all()

    def hold(self) -> float:
        """Hold new engine calls and wait for the one in flight; returns the seconds waited."""
        start = time.perf_counter()
        with self.cond:
            if self.held_since is not None:
                raise RuntimeError("the engine gate is already held")
            self.held_since = start
            wait_for_handling_signals(self.cond, lambda: self.calls == 0)  # the driver's main thread: an engine call's length
        return time.perf_counter() - start

    def release(self) -> float:
        """Let engine calls through again; returns the seconds engine calls were held: from the first call that waited
        at the gate, 0 when none did (an idle collector's wait is ``waiting_for_pacing``'s, not counted twice)."""
        with self.cond:
            held = time.perf_counter() - self.blocked_since if self.blocked_since is not None else 0.0
            self.held_seconds += held
            self.held_since = self.blocked_since = None
            self.cond.notify_all()
        return held

    def close(self) -> None:
        """Fail the calls waiting at the gate and any later one (the run is stopping)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()


@dataclass
class AgentHandles(EnvironmentHandles):
    """The run's environment handles plus the driver side of its agent tasks (``agents``); the rollout helpers hand
    agent batches to it (:func:`nemo_like.experience.rollouts.collect_rollout`)."""

    agents: AgentRollouts | None = None


def load_agents(specs: dict[str, EnvSpec], tasks: tuple[str, ...]) -> dict[str, AgentSettings]:
    """Every agent task's function and limits, imported and checked in the driver before any actor starts."""
    return {task: load_agent_settings(task, specs[task].kwargs) for task in tasks}


def start_agent_rollouts(
    cfg: Any, tokenizer: Any, engine: Any, eos_token_ids: list[int], settings: dict[str, AgentSettings]
) -> AgentRollouts:
    """Start the rollout server on the driver (127.0.0.1, a free port, a random key) over ``engine``, sampling with
    its current weights, for the agent tasks' ``settings`` (:func:`load_agents`)."""
    config = ServerConfig(
        auto_create_sessions=False,
        require_session=True,
        max_context=cfg.policy.max_total_sequence_length,
        seed=cfg.grpo.seed,
        run_sampling=run_sampling(cfg.policy.generation, enforce=True),
        vocab_size=model_vocab_size(cfg.policy.model_name),
    )
    gate = EngineGate(engine)  # a pass-through until an async refit holds it
    server = RolloutServer(gate, tokenizer, config, eos_token_ids=list(eos_token_ids)).start()
    return AgentRollouts(server, settings, tokenizer, gate)


def shut_down(agents: AgentRollouts | None, parts: Iterable[Any]) -> None:
    """End a run's or an eval's rollouts: the rollout server first (it serves what was queued, up to a minute: a second
    signal gets through, :func:`~nemo_like.utils.stop_signals.call_handling_signals`), then every part that is not
    ``None`` (``shutdown()``), even when the server's stop raised."""
    try:
        if agents is not None:
            call_handling_signals(agents.server.stop)
    finally:
        for part in parts:
            if part is not None:
                part.shutdown()
