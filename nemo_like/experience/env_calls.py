"""The one path from the driver to the environment actors, for single-turn scoring and multi-turn steps alike.

Each sample goes to the environment of its prompt's task (``metadata["task_name"]``); a task's samples are split
into contiguous shards, one per actor of that task; every shard is requested at once (all tasks concurrently), and
:meth:`PendingEnvCalls.gather` puts the results back in sample order and sums each actor's counters per task as
``env/<task>/<name>``. ``score`` and ``step`` (:class:`~nemo_like.environments.worker.EnvironmentWorker`) both
take ``(per-sample inputs, per-sample metadata)`` and return ``(per-sample results, counters)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from nemo_like.distributed.faults import inject
from nemo_like.distributed.supervision import Call, dispatch, gather_or_fail
from nemo_like.environments.registry import route_by_task
from nemo_like.utils.sharding import contiguous_shards


@dataclass
class PendingEnvCalls:
    """Environment calls in flight (:func:`call_environments`); :meth:`gather` waits for them."""

    size: int
    calls: list[tuple[str, list[int]]]  # (task, the samples' indices) of each request
    refs: list
    what: str  # the phase named in errors ("reward", "environment step")
    replaceable: list[Call] | None = None  # each request, to re-send to a replaced actor (driver side); None: a death is an error

    def gather(self) -> tuple[list[Any], dict[str, float]]:
        """One result per sample, in sample order, and the environments' counters summed per task."""
        results: list[Any] = [None] * self.size
        counters: dict[str, float] = {}
        for (task, rows), (shard_results, shard_counters) in zip(self.calls, gather_or_fail(self.replaceable, self.refs, self.what)):
            for row, result in zip(rows, shard_results):
                results[row] = result
            for name, value in shard_counters.items():
                key = f"env/{task}/{name}"
                counters[key] = counters.get(key, 0.0) + value
        return results, counters


def call_environments(
    envs: Any,
    method: str,
    inputs: list[Any],
    metadata: list[dict[str, Any]],
    what: str,
    routing: list[dict[str, Any]] | None = None,
) -> PendingEnvCalls:
    """Call ``method`` (``"score"`` or ``"step"``) of the run's environment actors (an
    :class:`~nemo_like.environments.worker.EnvironmentHandles`) on every sample's ``inputs[i]`` with its
    ``metadata[i]``, routed by task and sharded over each task's actors; returns without waiting. ``routing``: the
    metadata whose ``task_name`` routes each sample (default ``metadata``; a multi-turn step routes by the prompt's,
    since an environment may replace a conversation's metadata). On the driver, an actor that dies is replaced and
    its request sent again (:mod:`nemo_like.distributed.supervision`)."""
    calls: list[tuple[str, list[int]]] = []
    submits = []
    for task, indices in route_by_task(routing if routing is not None else metadata, envs.tasks).items():
        for rank, rows in enumerate(contiguous_shards(indices, len(envs.workers[task]))):
            calls.append((task, rows))
            submits.append((task, rank, partial(_submit, method, [inputs[i] for i in rows], [metadata[i] for i in rows], not submits)))
    replaceable = getattr(envs, "replaceable", None)
    if replaceable is None:
        refs = [submit(envs.workers[task][rank]) for task, rank, submit in submits]
        return PendingEnvCalls(len(inputs), calls, refs, what)
    requests = [Call(replaceable[task], rank, submit) for task, rank, submit in submits]
    return PendingEnvCalls(len(inputs), calls, dispatch(requests), what, requests)


def _submit(method: str, inputs: list[Any], metadata: list[dict[str, Any]], first: bool, worker: Any) -> Any:
    """One environment request (sent again unchanged to a replacement); the fault-injection hook before the first
    (tests only: ``cluster.fault_injection`` role ``environment``, for ``score`` and multi-turn ``step`` calls)."""
    if first:
        inject("environment", "score", [worker])
    return getattr(worker, method).remote(inputs, metadata)
