"""What the math environment's checker costs: starting its helper process (importing math-verify and sympy), and
checking one answer, measured on the client side of :class:`~nemo_like.environments.math_verify_process.MathVerifyProcess`
(the call an environment actor makes per response).

Usage: python benchmarks/math_verify_cost.py [--answers 200] [--starts 3]

Answers are distinct (integers, decimals, ``\\frac`` forms, boxed and plain), so no parse is cached; prints the median,
90th percentile and maximum milliseconds per checked answer, and the seconds of each start.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from nemo_like.environments.math_verify_process import MathVerifyProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=200)
    parser.add_argument("--starts", type=int, default=3)
    args = parser.parse_args()
    starts = []
    for _ in range(args.starts):  # a start: the process up and its first answer checked
        checker = MathVerifyProcess(timeout_s=5.0)
        began = time.perf_counter()
        checker.check(r"\boxed{1}", "1")
        starts.append(time.perf_counter() - began)
        checker.close()
    checker = MathVerifyProcess(timeout_s=5.0)
    checker.check(r"\boxed{1}", "1")
    rng, per_answer, outcomes = random.Random(0), [], {}
    for _ in range(args.answers):
        value = rng.randint(2, 10**6)
        gold = rng.choice([str(value), f"{value}.0", rf"\frac{{{2 * value}}}{{2}}", str(value + 1)])
        response = rng.choice([rf"The answer is \boxed{{{value}}}.", f"so {value}", rf"\boxed{{{value}.0}}"])
        began = time.perf_counter()
        outcome = checker.check(response, gold)
        per_answer.append((time.perf_counter() - began) * 1000)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    checker.close()
    ordered = sorted(per_answer)
    print(f"start (process up + first answer): {', '.join(f'{s:.2f}' for s in starts)} s")
    print(
        f"per checked answer ({args.answers} distinct): median {statistics.median(per_answer):.2f} ms, "
        f"p90 {ordered[int(0.9 * len(ordered)) - 1]:.2f} ms, max {ordered[-1]:.1f} ms; outcomes {outcomes}"
    )


if __name__ == "__main__":
    main()
