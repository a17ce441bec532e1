"""Attention on a CPU in bfloat16 against float32, side by side in one invocation.

Usage: python benchmarks/cpu_attention.py [--reps 20]

``F.scaled_dot_product_attention`` at the vs-TRL W2 shapes (6 query heads, 2 key/value heads, head dim 64): a training
micro-batch's completions (64 rows, 64 queries over 85 keys, grouped-query, forward and backward) and a decode step (64
rows, 1 query over 85 keys), with bf16 inputs (what CPU autocast gives it) and float32 inputs. Prints the milliseconds
of each and the ratio bf16/fp32. On the machines measured bf16 was the slower one, which is why
:mod:`nemo_like.models.attention` runs attention in float32 on a CPU under autocast
(docs/guides/performance.md, "bfloat16 on a CPU").
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"training (fwd+bwd)": (64, 64, 85, True), "decode step": (64, 1, 85, False)}  # rows, queries, keys, backward


def milliseconds(dtype: torch.dtype, rows: int, queries: int, keys: int, backward: bool, reps: int) -> float:
    """Mean milliseconds of one attention call (and its backward) in ``dtype``."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, 6, queries, 64, generator=g).to(dtype).requires_grad_(backward)
    k, v = (torch.randn(rows, 2, keys, 64, generator=g).to(dtype).requires_grad_(backward) for _ in range(2))
    mask = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)[None, None].expand(rows, 1, -1, -1)

    def once() -> None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        if backward:
            out.float().sum().backward()

    for _ in range(3):
        once()
    start = time.perf_counter()
    for _ in range(reps):
        once()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print("| shape | bf16 ms | fp32 ms | bf16/fp32 |\n|---|---|---|---|")
    for name, shape in SHAPES.items():
        bf16, fp32 = (milliseconds(dtype, *shape, args.reps) for dtype in (torch.bfloat16, torch.float32))
        print(f"| {name} | {bf16:.2f} | {fp32:.2f} | {bf16 / fp32:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
