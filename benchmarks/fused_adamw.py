"""AdamW's fused step (one kernel over every parameter: what the policy worker uses) against torch's default
(foreach: one kernel per tensor list), side by side on the same parameters, in-process.

Usage: python benchmarks/fused_adamw.py [--sizes 1m 10m] [--steps 20] [--threads 2]

For each size, the parameters of the model ``benchmarks/vs_trl.py`` builds (random init, float32, with gradients
filled once), then ``--steps`` optimizer steps with each implementation, alternating step by step; prints the median
milliseconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from vs_trl import SIZES, build_model


def step_ms(optimizer: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    optimizer.step()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["1m", "10m"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            name, n_params = build_model(Path(tmp), size)
            models = [AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32) for _ in range(2)]
        for model in models:
            for p in model.parameters():
                p.grad = torch.randn_like(p) * 1e-3
        fused = torch.optim.AdamW(models[0].parameters(), lr=1e-5, fused=True)
        foreach = torch.optim.AdamW(models[1].parameters(), lr=1e-5, foreach=True)
        step_ms(fused), step_ms(foreach)  # the first step allocates the moments
        times: dict[str, list[float]] = {"fused": [], "foreach": []}
        for _ in range(args.steps):
            times["fused"].append(step_ms(fused))
            times["foreach"].append(step_ms(foreach))
        a, b = statistics.median(times["fused"]), statistics.median(times["foreach"])
        print(f"{size} ({n_params / 1e6:.1f}M params): fused {a:.2f} ms, foreach {b:.2f} ms a step (fused/foreach {a / b:.2f})")


if __name__ == "__main__":
    main()
