"""In-flight weight updates: apply a refit that arrives during a ``generate`` call at the next decoding step.

A generation actor that should accept refits mid-generation runs with ``max_concurrency=2`` (one
thread generates, the other receives the refit). The refit thread hands its update to the
:class:`WeightUpdateGate` and waits; the generating thread applies it between two decoding steps
(:meth:`WeightUpdateGate.apply_pending`), so the engine is never touched by two threads at once.
Tokens sampled before the swap keep the logprobs of the old weights, tokens after it those of the
new ones. Without a generation running, an update is applied at once.

A refit that raises partway (a shape that does not fit, a shared buffer rewritten while it was copied) has already
overwritten some parameters: the gate then holds the engine *unusable* (:meth:`WeightUpdateGate.check_usable`), so
neither a new generate call nor the one in flight samples from the mix, until a refit succeeds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class WeightUpdateGate:
    """Serialises weight updates with decoding steps; counts the updates applied mid-generation."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.generate_lock = threading.Lock()  # at most one generate call at a time
        self.generating = False
        self.calls = 0  # generate calls in their scope: running, or waiting for the one that runs
        self.pending: list[dict[str, Any]] = []
        self.mid_generation_updates = 0
        # Spent loading updates on the generating thread inside a generate call (not decoding): those between two
        # decoding steps and those that arrived during the last one, loaded as the call ends (inside its time as well).
        self.mid_generation_seconds = 0.0
        self.unusable: str | None = None  # why the weights are a mix of two versions (a refit failed partway)

    def submit(self, apply: Callable[[], Any], version: int | None = None, overwrites: bool = True) -> Any:
        """Run ``apply`` now when idle, else at the next decoding step; returns its result (or raises its error, and,
        for an update that ``overwrites`` the served weights in place, then holds the engine unusable until an update
        succeeds: ``version`` names the refit in the message; a LoRA adapter swap, which serves the old adapter until
        the new one loaded, overwrites nothing)."""
        apply = self._guarded(apply, version) if overwrites else apply
        with self.cond:
            if not self.generating:
                return apply()
            job: dict[str, Any] = {"apply": apply}
            self.pending.append(job)
            self.cond.wait_for(lambda: "result" in job or "error" in job)
        if "error" in job:
            raise job["error"]
        return job["result"]

    def _guarded(self, apply: Callable[[], Any], version: int | None) -> Callable[[], Any]:
        def run() -> Any:
            try:
                result = apply()
            except BaseException as exc:
                self.unusable = (
                    f"the refit to weight version {version} failed partway ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}): "
                    "the engine's weights are a mix of two versions, and it samples nothing until a refit succeeds"
                )
                raise
            self.unusable = None
            return result

        return run

    def check_usable(self) -> None:
        """Raise ``RuntimeError`` while the weights are a failed refit's mix (see the module docstring)."""
        if self.unusable is not None:
            raise RuntimeError(self.unusable)

    def apply_pending(self, mid_generation: bool = True) -> int:
        """Called by the generating thread between decoding steps; returns how many updates it applied.
        ``mid_generation=False``: the generate call has ended (the updates are not counted as in flight)."""
        with self.cond:
            jobs, self.pending = self.pending, []
            if not jobs:  # every decoding step asks: nothing to time or notify
                return 0
            started = time.perf_counter()
            for job in jobs:
                try:
                    job["result"] = job["apply"]()
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting refit call
                    job["error"] = exc
            if mid_generation:
                self.mid_generation_updates += len(jobs)
            if self.generating:  # inside a generate call (mid-sequence, or at its end): in the call's time
                self.mid_generation_seconds += time.perf_counter() - started
            self.cond.notify_all()
            return len(jobs)

    def busy_with(self) -> str | None:
        """``'a generate call'`` while one is in its scope (running, or queued behind the one that runs), else None
        (:meth:`~nemo_like.distributed.reinit.Reinitializable.busy_with`)."""
        with self.cond:
            return "a generate call" if self.calls else None

    @contextmanager
    def generating_scope(self) -> Iterator[None]:
        """Mark a generate call; updates that arrive meanwhile wait for :meth:`apply_pending` (or its end). A worker
        enters it first thing in ``generate``, so the call counts as busy from its start."""
        with self.cond:
            self.calls += 1
        try:
            with self.generate_lock:
                with self.cond:
                    self.generating = True
                try:
                    yield
                finally:
                    with self.cond:  # (a re-entrant lock) apply what arrived late before a new update can go straight in
                        self.apply_pending(mid_generation=False)
                        self.generating = False
        finally:
            with self.cond:
                self.calls -= 1
