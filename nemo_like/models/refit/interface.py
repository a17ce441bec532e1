"""The one interface between the two sides of a refit.

* The **sender** (:class:`WeightSender`: the trainable :class:`~nemo_like.models.policy.policy.Policy`) owns the
  weights and their version, and exports them on request (:meth:`WeightSender.weight_buckets`: object-store buckets
  or a shared-memory buffer, per :mod:`.transport`).
* A **receiver** (:class:`WeightReceiver`: every generation engine) loads a version (:meth:`WeightReceiver.refit`).
  It is handed a :data:`WeightSource`: the exported weights, or the sender's exporter itself, which a receiver calls
  (:func:`export_weights`) only when its transport reads an export; the GPU transports (CUDA IPC, NCCL) read the
  sender's rank-0 tensors instead and never export.

The loop's whole refit is ``receiver.refit(sender.weight_buckets, sender.weight_version)`` when the versions differ.
"""

from __future__ import annotations

from typing import Any, Protocol

#: What a refit is handed: the exported weights (buckets, or an object ref to them), or the exporter that makes them.
WeightSource = Any


def export_weights(weights: WeightSource) -> Any:
    """The weights to send: ``weights`` itself, or what it returns when it is an exporter (a callable)."""
    return weights() if callable(weights) else weights


class WeightSender(Protocol):
    """The side that trains: its current weights, their version, and what a refit sends (``refit_mode``: ``full``,
    ``adapter`` or ``merged``, from the run plan)."""

    weight_version: int
    refit_mode: str

    def weight_buckets(self) -> Any:
        """Export the current weights for a refit (:class:`~.buckets.WeightBuckets` or its shared-memory form)."""


class WeightReceiver(Protocol):
    """The side that samples: the version it holds, and loading a new one."""

    weight_version: int

    def refit(self, weights: WeightSource, version: int) -> float:
        """Load weight version ``version`` from ``weights`` (see :data:`WeightSource`); returns the seconds spent."""
