"""The re-initialisation contract of kept actors, importable without Ray (a bare GPU check imports the workers)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any


class Reinitializable:
    """Mixin for worker classes whose actors :func:`reuse_actors` may keep between runs.

    ``reinit`` must leave the actor exactly as a fresh one built with the same arguments (the default
    runs ``__init__`` again); ``reuse_key`` names the constructor arguments a kept actor cannot change
    in place (the default: none, since ``__init__`` rebuilds everything).

    ``SETS_THREADS_ON_INIT``: the class applies its thread count itself on (re-)initialisation
    (:func:`~nemo_like.distributed.threads.apply_thread_count` with the count it is given), so a kept actor
    may serve a group with another ``WorkerResources.num_threads``: runs that differ only in the thread split
    (sync vs async, the prev pass on or off) share actors. Off by default: a class whose threads are fixed at
    process start (an engine that spawns its own processes) keeps them in the key.
    """

    SETS_THREADS_ON_INIT = False

    def reinit(self, **init_kwargs: Any) -> None:
        self.__init__(**init_kwargs)

    def busy_with(self) -> str | None:
        """What a call of the last run still does on another thread of this actor (a threaded actor's, e.g. a
        generate call the run's end left running), or None: a kept actor is re-initialised only when idle, never
        under a running call. A single-threaded actor cannot answer while busy (its hung call is timed out)."""
        return None

    @classmethod
    def reuse_key(cls, init_kwargs: dict[str, Any]) -> Hashable:
        return ()
