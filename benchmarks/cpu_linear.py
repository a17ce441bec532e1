"""Float32 linear on this CPU: torch's ``F.linear`` (BLAS: MKL in the pinned wheel) against oneDNN's matmul
(``torch.ops.mkldnn._linear_pointwise``, what :mod:`nemo_like.utils.cpu_linear` sends larger products to),
same inputs, alternating, side by side in one run.

Usage: python benchmarks/cpu_linear.py [--threads 2] [--repeats 7]   (about 3 minutes on a 2-core machine)
       python benchmarks/cpu_linear.py --updates [--repeats 7]       (whole training updates, about 1 minute)

Shapes ``M x K -> N``: the decode and prefill products of the vs-TRL W2 model (10M, hidden 384, 64 rows), W3's decode
products (35M, hidden 768), those of the tiny recipe's model (hidden 128) and of W1 (8 rows), and a 1024^3 square.
Prints each side's median microseconds and GFLOP/s, oneDNN's time on a weight packed once into its own layout
(:func:`~nemo_like.utils.cpu_linear.prepacked`, what the lean decoder's decode products use), the ratio (oneDNN /
F.linear time, unpacked) and whether :func:`~nemo_like.utils.cpu_linear.uses_onednn` takes oneDNN for that product
under ``torch.no_grad()`` (its threshold: ``ONEDNN_MIN_MACS``).

``--updates`` times whole training updates instead: our ``PolicyWorker.train`` in-process (the default recipe's loss
and optimizer; ``benchmarks/compile_training.py`` builds it) on the W1 and W2 batches of ``benchmarks/vs_trl.py``
(1 prompt x 8 completions x 16 tokens; 8 x 8 x 64), update by update alternating between the two routes of an
unpacked product (:func:`~nemo_like.utils.cpu_linear.onednn_beats_blas` forced true, then false), one warm-up
update each, and prints each route's median and their ratio (oneDNN / F.linear): what the vendor rule chooses between.

A second table times the weight gradient ``dy.T @ x`` of training's products (``M`` = tokens of a W2 / W3 training
forward): through oneDNN on the transposed operands (which it first copies into its own layout) against BLAS's
``torch.mm``, which reads them transposed in place; :class:`~nemo_like.utils.cpu_linear.OneDNNLinear` takes BLAS.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from nemo_like.utils.cpu_linear import onednn_linear_available, uses_onednn

SHAPES = [
    ("W2 decode, gate/up", 64, 384, 3584),
    ("W2 decode, down", 64, 1792, 384),
    ("W2 decode, qkv", 64, 384, 640),
    ("W2 prefill, gate/up", 8 * 22, 384, 3584),
    ("W3 decode, gate/up", 64, 768, 6144),
    ("W3 decode, down", 64, 3072, 768),
    ("tiny decode, qkv", 64, 128, 256),
    ("tiny decode, gate/up", 64, 128, 1024),
    ("W1 decode, gate/up", 8, 128, 1024),
    ("W1 decode, qkv", 8, 128, 256),
    ("square 1024^3", 1024, 1024, 1024),
]
# Weight gradients dW = dy.T @ x: (name, tokens M, in features K, out features N).
WEIGHT_GRAD_SHAPES = [
    ("W2 train, gate/up", 8 * 21 + 64 * 64, 384, 1792),
    ("W2 train, down", 8 * 21 + 64 * 64, 1792, 384),
    ("W2 train, q/o", 8 * 21 + 64 * 64, 384, 384),
    ("W3 train, gate/up", 8 * 21 + 64 * 128, 768, 3072),
    ("W3 train, down", 8 * 21 + 64 * 128, 3072, 768),
    ("W3 train, q/o", 8 * 21 + 64 * 128, 768, 768),
]


def seconds_per_call(fn, budget_s: float = 0.2) -> float:
    """Median of 5 timed batches of calls, each batch about ``budget_s / 5`` long."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < budget_s / 5:
        fn()
        calls += 1
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def time_updates(threads: int, repeats: int) -> None:
    """``--updates``: W1- and W2-sized training updates, unpacked products through oneDNN against F.linear, alternating."""
    import tempfile
    from pathlib import Path

    from compile_training import policy_worker_and_batch
    from transformers import AutoConfig
    from vs_trl import WORKLOADS, build_model

    from nemo_like.utils import cpu_linear
    from nemo_like.utils.cpus import cpuinfo_field

    print(f"{threads} threads, {repeats} updates each way, alternating; this CPU: {cpuinfo_field('vendor_id')}, "
          f"the rule takes {'oneDNN' if cpu_linear.onednn_beats_blas() else 'F.linear'}")  # fmt: skip
    print(f"{'workload':9s} {'oneDNN s':>9s} {'F.linear s':>11s} {'oneDNN / F.linear':>18s}")
    for name in ("W1", "W2"):
        work = WORKLOADS[name]
        with tempfile.TemporaryDirectory(prefix="cpu_linear_") as tmp:
            model_dir, _ = build_model(Path(tmp) / "model", work["size"])
            vocab = AutoConfig.from_pretrained(model_dir).vocab_size
            torch.manual_seed(0)
            prompts = torch.randint(0, vocab - 1, (work["prompts"], 21)).repeat_interleave(work["generations"], dim=0)
            ids = torch.cat([prompts, torch.randint(0, vocab - 1, (prompts.shape[0], work["new_tokens"]))], dim=1)
            worker, batch = policy_worker_and_batch(model_dir, ids, threads, True, work["new_tokens"])
            times: dict[bool, list[float]] = {True: [], False: []}
            rule = cpu_linear.onednn_beats_blas
            try:
                for i in range(2 * (repeats + 1)):
                    onednn = i % 2 == 0
                    cpu_linear.onednn_beats_blas = functools.partial(bool, onednn)
                    start = time.perf_counter()
                    worker.train([batch])
                    times[onednn].append(time.perf_counter() - start)
            finally:
                cpu_linear.onednn_beats_blas = rule
            o, b = statistics.median(times[True][1:]), statistics.median(times[False][1:])
            print(f"{name:9s} {o:9.4f} {b:11.4f} {o / b:18.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--updates", action="store_true", help="time whole training updates both ways instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not onednn_linear_available():
        raise SystemExit("oneDNN's linear op is not used on this machine (x86-64 with a oneDNN torch build only)")
    if args.updates:
        time_updates(args.threads, args.repeats)
        return
    print(f"{args.threads} threads, median of {args.repeats} alternating rounds")
    print(
        f"{'product':22s} {'M x K -> N':>18s} {'F.linear us':>12s} {'oneDNN us':>10s} {'packed us':>10s} {'GFLOP/s':>17s} "
        f"{'ratio':>6s}  taken"
    )
    with torch.no_grad():
        for name, m, k, n in SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k)
            packed_w = torch.ops.mkldnn._reorder_linear_weight(w, m)  # what cpu_linear.prepacked builds
            plain, onednn, packed = [], [], []
            for _ in range(args.repeats):
                plain.append(seconds_per_call(functools.partial(F.linear, x, w)))
                onednn.append(seconds_per_call(functools.partial(torch.ops.mkldnn._linear_pointwise, x, w, None, "none", [], "")))
                packed.append(seconds_per_call(functools.partial(torch.ops.mkldnn._linear_pointwise, x, packed_w, None, "none", [], "")))
            p, o, pk, flop = statistics.median(plain), statistics.median(onednn), statistics.median(packed), 2 * m * k * n
            print(
                f"{name:22s} {f'{m} x {k} -> {n}':>18s} {p * 1e6:12.1f} {o * 1e6:10.1f} {pk * 1e6:10.1f} "
                f"{f'{flop / p / 1e9:.0f}/{flop / o / 1e9:.0f}/{flop / pk / 1e9:.0f}':>17s} {o / p:6.2f}  "
                f"{'oneDNN' if uses_onednn(x, w) else 'F.linear'}"
            )
        print(f"\nweight gradient dy.T @ x, median of {args.repeats} alternating rounds")
        print(f"{'product':22s} {'tokens x K -> N':>18s} {'torch.mm us':>12s} {'oneDNN us':>10s} {'GFLOP/s':>13s} {'ratio':>6s}")
        for name, m, k, n in WEIGHT_GRAD_SHAPES:
            x, dy = torch.randn(m, k), torch.randn(m, n)
            blas, onednn = [], []
            for _ in range(args.repeats):
                blas.append(seconds_per_call(functools.partial(torch.mm, dy.t(), x), budget_s=0.5))
                onednn.append(
                    seconds_per_call(
                        functools.partial(torch.ops.mkldnn._linear_pointwise, dy.t(), x.t(), None, "none", [], ""), budget_s=0.5
                    )
                )
            b, o, flop = statistics.median(blas), statistics.median(onednn), 2 * m * k * n
            print(
                f"{name:22s} {f'{m} x {k} -> {n}':>18s} {b * 1e6:12.0f} {o * 1e6:10.0f} "
                f"{flop / b / 1e9:6.0f}/{flop / o / 1e9:<6.0f} {o / b:6.2f}"
            )


if __name__ == "__main__":
    main()
