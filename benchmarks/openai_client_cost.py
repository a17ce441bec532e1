"""What building an ``openai.OpenAI`` client costs (its ``httpx`` client builds a TLS context and loads the CA bundle,
even for a plain-HTTP server): the reason an agent should build one client per run, not one per session.

Usage: python benchmarks/openai_client_cost.py [--builds 20]

Prints the CPU milliseconds per build (``time.process_time``: the driver's CPU, what a session per client spent) as the
median, minimum and maximum over ``--builds`` builds, and the installed openai version.
"""

from __future__ import annotations

import argparse
import statistics
import time

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builds", type=int, default=20)
    args = parser.parse_args()
    openai.OpenAI(base_url="http://127.0.0.1:1/v1", api_key="x").close()  # imports and first-use caches
    costs = []
    for _ in range(args.builds):
        began = time.process_time()
        client = openai.OpenAI(base_url="http://127.0.0.1:1/v1", api_key="x")
        costs.append((time.process_time() - began) * 1000)
        client.close()
    print(
        f"openai {openai.__version__}: CPU ms per OpenAI() build over {args.builds}: median {statistics.median(costs):.1f}, "
        f"min {min(costs):.1f}, max {max(costs):.1f}"
    )


if __name__ == "__main__":
    main()
