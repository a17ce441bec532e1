"""Float32 linear layers on an x86 CPU through oneDNN instead of torch's BLAS (MKL), forward and backward, where
oneDNN is the faster of the two.

On AMD CPUs (the project's earlier machines: AMD EPYC, 2 cores) ``F.linear`` in float32 ran at ~160-190 GFLOP/s
whatever the shape, while oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the op Inductor's CPU backend
emits) ran the same product at ~350-400 GFLOP/s, to float32 rounding (relative difference ~1e-6). On Intel CPUs MKL
takes its own fast code paths: on a 2-core Intel Xeon (AMX) ``F.linear`` matched oneDNN on the W2 and W3 products
(0.92-1.17x oneDNN's time) and beat it 1.4-2.8x on the tiny model's, so there products stay with ``F.linear``
(:func:`onednn_beats_blas`): whole training updates took oneDNN 1.18-1.19x ``F.linear``'s time at W1 and 1.05-1.17x
at W2 (``python benchmarks/cpu_linear.py --updates``). ``python benchmarks/cpu_linear.py`` measures the products. On small products oneDNN's per-call cost (~15-25 us)
loses everywhere, so products under :data:`ONEDNN_MIN_MACS` multiply-accumulates keep ``F.linear``.

A weight packed once into oneDNN's layout for many products (:func:`prepacked`: the lean sampler's decode products)
is the faster product on both vendors above :data:`PACK_MIN_MACS` (Intel, W2's decode: 0.77-0.98x ``F.linear``'s
time), so packing does not depend on the vendor.

The op has no autograd formula; :class:`OneDNNLinear` gives it one: the input gradient is one more oneDNN product, the
weight gradient ``dy.T @ x`` goes to BLAS, which reads both transposed operands in place (oneDNN would first copy the
``tokens x out`` gradient into a transposed layout). At the vs-TRL W2 and W3 training shapes oneDNN took 0.91-1.45x
BLAS's time on that product (1.03-1.39x at W3, 2026-12-03; ``python benchmarks/cpu_linear.py`` prints both), and a W3
training forward and backward ran 9 % faster with BLAS's (W2: 2 %, within noise). Only plain float32 CPU tensors
outside autocast take it: DTensor (sharded) parameters, other dtypes and devices, and other machines keep ``F.linear``.
"""

from __future__ import annotations

import functools
import platform

import torch
import torch.nn.functional as F

from nemo_like.utils.cpus import cpuinfo_field

ONEDNN_MIN_MACS = 1 << 21  # measured crossover: 64x128x256 (2.1M) breaks even, 8x128x256 (0.26M) loses 1.9x
# Packing a weight (prepacked) costs ~125-210 us on small weights (360 us on W2's gate/up) and saves 0-6 us per
# product up to 2^23 multiply-accumulates (64 rows x 128 -> 256 ... 1024: the tiny model's products; its sampling with
# gate/up packed: 2 % slower), ~25-110 us above (64 x 384 -> 384 ... 3584, W2's: paid back within 3-6 decode steps).
PACK_MIN_MACS = 1 << 23  # packs products of more than this
_PLAIN = (torch.Tensor, torch.nn.Parameter)


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's linear op and runs on x86-64 (where it was measured to win)."""
    return (
        platform.machine().lower() in {"x86_64", "amd64"}
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


#: CPU vendors (``vendor_id`` in ``/proc/cpuinfo``) on which MKL's float32 GEMM runs well below oneDNN's.
SLOW_BLAS_VENDORS = frozenset({"AuthenticAMD"})


@functools.cache
def onednn_beats_blas() -> bool:
    """Whether :func:`linear` sends larger unpacked float32 products to oneDNN on this machine: where oneDNN's op is
    available and the CPU is one on which MKL runs its slower generic code (:data:`SLOW_BLAS_VENDORS`: AMD). Decided
    by the vendor, not by timing both at start-up, so that a machine always computes with the same kernels (a timed
    choice would flip between runs on a busy machine, and with it the last bits of every product)."""
    return onednn_linear_available() and cpuinfo_field("vendor_id") in SLOW_BLAS_VENDORS


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # oneDNN reads the bias as dense memory whatever its strides: a strided or expanded one gave wrong sums
    return torch.ops.mkldnn._linear_pointwise(x, weight, None if bias is None else bias.contiguous(), "none", [], "")


class OneDNNLinear(torch.autograd.Function):
    """``x @ weight.T + bias`` through oneDNN, and its gradients: ``dx = dy @ weight`` through oneDNN, ``dweight = dy.T @ x``
    (flattened over the leading dimensions) through BLAS (see the module docstring), ``dbias = sum(dy)``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: D102
        x, weight = ctx.saved_tensors
        grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = _onednn(grad_2d, weight.t(), None).view(x.shape) if need_x else None
        grad_w = torch.mm(grad_2d.t(), x_2d) if need_w else None
        grad_b = grad_2d.sum(0) if ctx.has_bias and need_b else None
        return grad_x, grad_w, grad_b


def _onednn_takes(macs: int, dtype: torch.dtype) -> bool:
    """Whether oneDNN can serve a CPU product of ``macs`` multiply-accumulates in ``dtype``: float32, no CPU autocast, at
    least :data:`ONEDNN_MIN_MACS`, on an x86 machine with the op."""
    return macs >= ONEDNN_MIN_MACS and dtype == torch.float32 and not torch.is_autocast_enabled("cpu") and onednn_linear_available()


def _onednn_serves(rows: int, weight: torch.Tensor) -> bool:
    """Whether a product of ``rows`` rows with the plain (unpacked) float32 CPU ``weight`` goes to oneDNN (no CPU
    autocast, :func:`onednn_beats_blas`). The size test comes first: most products of a small model stop there, and
    :func:`linear` asks for every one."""
    macs = rows * weight.shape[0] * weight.shape[1]
    return (
        macs >= ONEDNN_MIN_MACS
        and type(weight) in _PLAIN
        and weight.device.type == "cpu"
        and _onednn_takes(macs, weight.dtype)
        and onednn_beats_blas()
    )


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` sends this product with an unpacked weight to oneDNN: plain (not DTensor) float32 CPU
    tensors, no CPU autocast, at least :data:`ONEDNN_MIN_MACS` multiply-accumulates, on a machine where oneDNN beats
    torch's BLAS (:func:`onednn_beats_blas`)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return _onednn_serves(rows, weight) and type(x) in _PLAIN and x.device.type == "cpu" and x.dtype == torch.float32


def packs(rows: int, out_features: int, in_features: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`prepacked` packs a plain CPU weight ``[out_features, in_features]`` of ``dtype`` for products of
    ``rows`` rows (more than :data:`PACK_MIN_MACS` multiply-accumulates, in float32 outside autocast, on an x86 machine
    with oneDNN's op: on either vendor, see the module docstring); the memory planner asks it too: a packed weight is
    a second copy of it for the call."""
    macs = rows * out_features * in_features
    return macs > PACK_MIN_MACS and _onednn_takes(macs, dtype)


def prepacked(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` reordered once into oneDNN's own blocked layout, for products of about ``rows`` rows (any row count
    works), where :func:`packs` says so; else ``weight`` itself. Inference only (no gradient flows into a packed copy).
    oneDNN otherwise reorders a plain weight on every call: a sampler that multiplies by the same weights at every
    decode step packs them once (8-14 % off each decode product at the W2 / W3 shapes; ``python
    benchmarks/cpu_linear.py`` prints both)."""
    if type(weight) not in _PLAIN or weight.device.type != "cpu" or not packs(rows, *weight.shape, weight.dtype):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; through oneDNN (forward and backward) where :func:`uses_onednn` says so, and
    always for a :func:`prepacked` weight."""
    if weight.is_mkldnn:
        return _onednn(x, weight, bias)
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return OneDNNLinear.apply(x, weight, bias)
    return _onednn(x, weight, bias)
