"""Numeric precision of the policy: fp32 master weights, bf16 compute; and the process group's backends.

``policy.precision: bfloat16`` never trains bf16 parameters. AdamW on bf16 weights rounds most updates away: at
lr 1e-6 one step changes ~2% of N(0, 0.02) weights and ~0.02% of norm weights (they sit near 1.0, where the bf16
spacing is 2^-7). So the parameters and the optimizer state stay in float32 (the *master* weights) and only the
forward and backward run in bf16:

* unsharded (dp 1, tp 1): ``torch.autocast`` around every forward (:func:`compute_context`);
* sharded: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (:func:`fsdp_mixed_precision`):
  parameters are all-gathered in bf16, gradients reduce-scattered in fp32 into fp32 shards.

Engines that only sample (vLLM, the HF generation actor) hold the weights in the compute dtype; a refit casts the
master weights to it (:func:`refit_dtype`). docs/guides/gpu.md has the measurements.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Parameters and optimizer state of a trained (or scored) policy, whatever ``policy.precision`` says.
MASTER_DTYPE = torch.float32


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype forwards and backwards run in (``policy.precision``)."""
    return DTYPES[precision]


def refit_dtype(precision: str) -> torch.dtype:
    """The dtype weights are sent to a generation engine in: the engine's own (it loads the model in ``precision``)."""
    return DTYPES[precision]


def uses_mixed_precision(precision: str) -> bool:
    """Whether compute runs in a lower dtype than the fp32 master weights."""
    return compute_dtype(precision) != MASTER_DTYPE


@contextlib.contextmanager
def compute_context(device: torch.device, precision: str, sharded: bool) -> Iterator[None]:
    """Autocast to the compute dtype around an unsharded model's forward (and so its backward); nothing when the
    precision is fp32 or FSDP2's mixed-precision policy already casts the parameters (``sharded``)."""
    if sharded or not uses_mixed_precision(precision):
        yield
        return
    with torch.autocast(device.type, dtype=compute_dtype(precision)):
        yield


@dataclass(frozen=True)
class AutocastState:
    """The autocast a custom autograd function's forward ran under, for its backward to run under too (autograd calls
    ``backward`` outside the forward's ``torch.autocast``, so a backward that recomputes a forward product, as the
    chunked logprob heads do, would otherwise do it in fp32: another function's gradient, and slow on a GPU)."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def current(cls, device: torch.device) -> AutocastState:
        return cls(device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))

    def __call__(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


def fsdp_mixed_precision(precision: str):
    """FSDP2's mixed-precision policy for ``precision`` (``None`` for fp32): bf16 parameters in the forward and
    backward, gradients reduced in fp32, outputs left as computed."""
    if not uses_mixed_precision(precision):
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute_dtype(precision), reduce_dtype=MASTER_DTYPE)


def process_group_backend(device_type: str) -> str:
    """The policy's process-group backend spec: gloo on a CPU; on GPUs NCCL for CUDA tensors *and* gloo for CPU
    tensors, because some collectives run on CPU tensors there (counters, checksums, CPU-offloaded FSDP2 shards in
    gradient clipping and state dicts): with ``nccl`` alone those fail with "No backend type associated with device
    type cpu"."""
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "cpu:gloo,cuda:nccl"
    raise ValueError(f"no process-group backend for device type {device_type!r} (expected 'cpu' or 'cuda')")
