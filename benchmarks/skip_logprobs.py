"""Step time with the prev-logprob pass skipped (``grpo.skip_prev_logprobs=auto``) vs computed (``false``).

Usage: python benchmarks/skip_logprobs.py [--steps 10] [overrides ...]
Prints the median step time of each run, their ratio, and the share of step time the prev pass took
when it ran. The first two steps of each run are warm-up and are left out of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from recipe_runs import run_recipe


def run(skip: str, steps: int, overrides: list[str], log_dir: str) -> list[dict]:
    return run_recipe(steps, log_dir, [f"grpo.skip_prev_logprobs={skip}", *overrides])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for skip in ("auto", "false"):
            history = run(skip, args.steps, args.overrides, f"{tmp}/{skip}")[2:]
            results[skip] = {
                "step": statistics.median(h["timing/train/total_step_time"] for h in history),
                "prev": statistics.median(h["timing/train/prev_logprobs"] for h in history),
                "passes": sum(h["performance/forward_passes/prev_logprobs"] for h in history),
            }
    skipped, computed = results["auto"], results["false"]
    print(f"median step time, prev pass skipped : {skipped['step']:.3f}s (prev forward passes: {skipped['passes']:.0f})")
    print(f"median step time, prev pass computed: {computed['step']:.3f}s (prev forward passes: {computed['passes']:.0f})")
    print(f"step-time ratio skipped/computed    : {skipped['step'] / computed['step']:.3f}")
    print(f"share of step time the prev pass took when computed: {computed['prev'] / computed['step']:.3f}")


if __name__ == "__main__":
    main()
