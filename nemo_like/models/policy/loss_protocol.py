"""What the policy worker needs of a loss: the boundary between ``models/policy`` and ``algorithms``.

The driver builds the run's loss (e.g. :class:`~nemo_like.algorithms.loss_functions.ClippedPGLossFn`) and hands it
to the workers in their :class:`~nemo_like.models.policy.spec.PolicyWorkerSpec`; the worker only calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class LossFunction(Protocol):
    """A micro-batch loss whose fragments add up to the global-batch loss."""

    def __call__(
        self,
        curr_logprobs: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
        /,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``(loss, metrics)`` of one micro-batch: ``curr_logprobs`` ``[n, S]`` under the current weights, ``batch`` its
        rows (on the worker's device), normalised by the valid sequences / tokens of the whole global batch."""
        ...

    def combine_metrics(self, fragments: list[dict[str, float]], /) -> dict[str, Any]:
        """One optimizer step's metrics on one rank from its micro-batches' fragments (or the ranks' results summed)."""
        ...

    def combine_steps(self, per_step: list[dict[str, float]], /, step_counts: list[dict[str, float]] | None = None) -> dict[str, Any]:
        """One rank's metrics of a :meth:`PolicyWorker.train` call from its optimizer steps' metrics (means weighed by
        ``step_counts``, each step's global valid ``tokens`` and ``sequences``; counts summed), so that the ranks'
        results still combine with :meth:`combine_metrics`."""
        ...
