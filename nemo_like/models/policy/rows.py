"""A policy batch's rows: slicing them and splitting them into one block per rank (no Ray, no model code)."""

from __future__ import annotations

import torch

Batch = dict[str, torch.Tensor]


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Rows ``start:stop`` of every per-sample tensor in ``batch`` (scalars are kept as they are)."""
    return {k: (v[start:stop] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in batch.items()}


def split_rows_unevenly(batch: Batch, num_shards: int) -> list[Batch]:
    """Split per-sample tensors into ``num_shards`` contiguous row blocks whose sizes differ by at most one
    (some may be empty): every rank of a sharded model must take part in a logprob pass."""
    size = batch["input_ids"].shape[0]
    bounds = [size * i // num_shards for i in range(num_shards + 1)]
    return [slice_batch(batch, bounds[i], bounds[i + 1]) for i in range(num_shards)]
