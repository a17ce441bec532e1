"""Weights in transit from the policy to generation: a manifest of names and one object-store ref per bucket.

The policy gathers its (possibly sharded) weights bucket by bucket and puts each bucket into Ray's
object store (:meth:`PolicyWorker.export_weight_buckets`); a generation worker fetches and loads one
bucket at a time, so neither side copies the whole model more than once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class WeightBuckets:
    """``names[i]`` are the tensors of the bucket behind ``refs[i]`` (a ``{name: tensor}`` dict).

    ``kind``: ``"full"`` (the model's weights under HF names) or ``"adapter"`` (LoRA adapter tensors under PEFT's
    saved names, with their ``adapter_config``); ``nbytes``: the tensors' total size."""

    version: int
    names: list[list[str]]
    refs: list[Any] = field(repr=False)
    kind: str = "full"
    nbytes: int = 0
    adapter_config: dict[str, Any] | None = None

    def all_names(self) -> list[str]:
        """Every tensor name, in order: the refit manifest."""
        return [n for bucket in self.names for n in bucket]

    def iter_buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """Fetch the buckets one at a time."""
        import ray

        for ref in self.refs:
            yield ray.get(ref)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs, one bucket in memory at a time."""
        for bucket in self.iter_buckets():
            yield from bucket.items()

    def check_intact(self) -> None:
        """Raise when the weights changed while a receiver read them; object-store buckets never do (see
        :meth:`SharedWeights.check_intact <nemo_like.models.refit.shared_memory.SharedWeights.check_intact>`)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor at once (tests and small models)."""
        return dict(self.iter_tensors())
