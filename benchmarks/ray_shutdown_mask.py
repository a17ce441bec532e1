"""What holding SIGTERM while Ray starts costs at exit: Ray's processes inherit the driver's blocked-signal mask, and
``ray.shutdown()`` gives each 1 s to end on SIGTERM before it kills it. ``train`` holds SIGTERM (so that a SIGTERM to
the whole process group spares the cluster while the driver saves); ``eval`` holds only SIGINT (Ray's processes block
it themselves). Each case starts a one-CPU local cluster in a fresh process and times its shutdown.

Usage: python benchmarks/ray_shutdown_mask.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CASE = """
import signal, sys, time
import ray
from nemo_like.utils.stop_signals import stop_signals_held
held = {"none": frozenset(), "sigint": frozenset({signal.SIGINT}), "sigterm+sigint": frozenset({signal.SIGINT, signal.SIGTERM})}
with stop_signals_held(lambda: None, held[sys.argv[1]]):
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
start = time.perf_counter()
ray.shutdown()
print(time.perf_counter() - start)
"""


def shutdown_seconds(held: str) -> float:
    """Seconds ``ray.shutdown()`` took after ``ray.init`` with ``held`` signals blocked, in a fresh process."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    out = subprocess.run([sys.executable, "-c", CASE, held], capture_output=True, text=True, check=True, env=env, timeout=300)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"none": [], "sigint": [], "sigterm+sigint": []}
    for _ in range(args.repeats):  # interleaved: a busy moment hits every case alike
        for held in times:
            times[held].append(shutdown_seconds(held))
    base = statistics.median(times["none"])
    for held, seconds in times.items():
        median = statistics.median(seconds)
        print(
            f"held while Ray starts: {held:<15} ray.shutdown {median:5.2f} s (x{median / base:.2f}; runs {', '.join(f'{s:.2f}' for s in seconds)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
