"""Small tensor helpers shared by the loss, the advantage estimators and the metrics.

Per-token tensors follow the project convention: ``[B, S]`` aligned with ``input_ids``; entry ``t``
holds a value for token ``x_t`` (e.g. ``log pi(x_t | x_<t)``), and masks are 1 on the response
tokens that count and 0 on prompt, padding and position 0.
"""

from __future__ import annotations

import torch


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    global_normalization_factor: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Mean of ``values`` over the entries where ``mask`` is 1.

    Args:
        values: any tensor.
        mask: same shape as ``values`` (broadcastable), 0/1 (bool or float).
        dim: reduce over this dimension only; ``None`` reduces over everything.
        global_normalization_factor: divide the masked sum by this instead of the local mask count.
            Pass the global number of valid tokens (or sequences) so that summing the results over
            microbatches and data-parallel ranks yields the full-batch mean.

    Returns:
        The masked mean; 0 (not NaN) where the mask is empty.
    """
    mask = mask.to(values.dtype)
    masked_sum = (values * mask).sum() if dim is None else (values * mask).sum(dim=dim)
    if global_normalization_factor is not None:
        denom = torch.as_tensor(global_normalization_factor, dtype=values.dtype, device=values.device)
    else:
        denom = mask.sum() if dim is None else mask.sum(dim=dim)
    # An empty mask gives 0, never NaN: clamp the denominator, the numerator is already 0.
    return masked_sum / denom.clamp(min=1e-12) if torch.is_tensor(denom) else masked_sum / denom
