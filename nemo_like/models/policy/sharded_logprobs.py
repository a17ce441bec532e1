"""Logprob passes over a policy's (or the reference's) workers from any process.

Kept apart from :mod:`.policy` and :mod:`.worker`: an actor that holds a :class:`ShardedLogprobs` (the async trajectory
collector runs the reference pass) needs neither the policy worker's model code nor the driver's facade.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
import torch

from nemo_like.distributed.faults import inject
from nemo_like.distributed.worker_group import get_with_context
from nemo_like.models.policy.rows import Batch, split_rows_unevenly


@dataclass(frozen=True)
class ShardedLogprobs:
    """Picklable handle for logprob passes over a policy's (or the reference's) workers: ``dp_size`` row blocks,
    each sent to every tensor-parallel rank of its data-parallel group. The facade uses it, and so can another
    actor (the async trajectory collector runs the reference pass on the batches it generates)."""

    workers: tuple[Any, ...]
    dp_size: int
    name: str

    def start(self, batch: Batch, **kwargs: Any) -> list[ray.ObjectRef]:
        """Start the pass; one ref per worker, in rank order (pass them to :meth:`gather`)."""
        # tests only (cluster.fault_injection, role reference: a LoRA run's reference pass runs on the policy's workers)
        inject("reference" if kwargs.get("reference") else self.name, "logprobs", list(self.workers))
        tp = len(self.workers) // self.dp_size  # the ranks of one tensor-parallel group see the same rows
        shards = split_rows_unevenly(batch, self.dp_size)
        return [w.get_logprobs.remote(shards[r // tp], **kwargs) for r, w in enumerate(self.workers)]

    def gather(self, refs: list[ray.ObjectRef], what: str) -> torch.Tensor:
        """Wait for a pass on every worker and stitch the row blocks (one per tensor-parallel group: its ranks return
        the same rows) back into one ``[B, S]`` tensor. Every rank is waited for, so an error on any is raised here."""
        tp = len(self.workers) // self.dp_size
        return torch.cat(get_with_context(refs, f"{self.name}: {what}")[::tp], dim=0)

    def forward_pass_counts(self) -> dict[str, int]:
        """Forward passes (micro-batches) by kind the workers ran so far, summed over the workers."""
        counts = get_with_context([w.get_forward_pass_counts.remote() for w in self.workers], f"{self.name}: counters")
        return {k: sum(c[k] for c in counts) for k in counts[0]}
