"""Inference-time linear layers on an x86 CPU through oneDNN instead of torch's BLAS (MKL).

On this project's CPU machines (AMD EPYC, 2 cores) ``F.linear`` in float32 runs at ~160-185 GFLOP/s whatever the
shape, while oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the op Inductor's CPU backend emits) runs the
same product at ~340-430 GFLOP/s, to float32 rounding (relative difference ~1e-6):
``python benchmarks/cpu_linear.py`` measures both side by side. On small products oneDNN's per-call cost (~15-25 us)
loses, so products under :data:`ONEDNN_MIN_MACS` multiply-accumulates keep ``F.linear``.

The op has no autograd, so :func:`linear` takes oneDNN only where no gradient is recorded (sampling); everywhere else,
and for other devices, dtypes or machines, it is ``F.linear``.
"""

from __future__ import annotations

import functools
import platform

import torch
import torch.nn.functional as F

ONEDNN_MIN_MACS = 1 << 21  # measured crossover: 64x128x384 (3.1M) already gains, 8x128x1024 (1.0M) loses


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's linear op and runs on x86-64 (where it was measured to win)."""
    return (
        platform.machine().lower() in {"x86_64", "amd64"}
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` sends this product to oneDNN: float32 CPU tensors, no gradient recorded, and at least
    :data:`ONEDNN_MIN_MACS` multiply-accumulates."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and (x.numel() // max(x.shape[-1], 1)) * weight.shape[0] * weight.shape[1] >= ONEDNN_MIN_MACS
        and onednn_linear_available()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; through oneDNN where :func:`uses_onednn` says so."""
    if uses_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
