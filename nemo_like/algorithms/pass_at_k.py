"""The unbiased pass@k estimator (Chen et al., 2021, "Evaluating Large Language Models Trained on Code").

With ``n`` samples of a prompt of which ``c`` are correct, the probability that ``k`` samples drawn
without replacement from those ``n`` contain at least one correct one is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

(exactly 1 when ``n - c < k``). The product form never builds the huge binomials. The benchmark's
pass@k is the mean over prompts. It is *not* "best of k bootstrapped samples": resampling with
replacement undercounts (1 correct out of 4 must give pass@4 = 1.0; with-replacement best-of-4 gives
1 - (3/4)^4 = 0.68).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct out of ``n`` samples (``1 <= k <= n``)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def correct_counts(correct: Sequence[bool] | torch.Tensor, group_ids: Sequence[int] | torch.Tensor) -> list[tuple[int, int]]:
    """``(n, c)`` per prompt (in order of first appearance) from per-sample correctness and prompt ids."""
    counts: dict[int, list[int]] = {}
    for ok, group in zip(_as_list(correct), _as_list(group_ids)):
        entry = counts.setdefault(int(group), [0, 0])
        entry[0] += 1
        entry[1] += int(bool(ok))
    return [(n, c) for n, c in counts.values()]


def mean_pass_at_k(counts: Iterable[tuple[int, int]], ks: Sequence[int]) -> dict[int, float]:
    """pass@k averaged over prompts, for each k; every prompt must have at least k samples."""
    counts = list(counts)
    if not counts:
        raise ValueError("pass@k of no prompts")
    return {k: sum(pass_at_k(n, c, k) for n, c in counts) / len(counts) for k in ks}


def _as_list(values) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)
