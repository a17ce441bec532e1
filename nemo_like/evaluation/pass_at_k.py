"""The pass@k estimator, importable from here too: it lives in :mod:`nemo_like.algorithms.pass_at_k` (the training
loop's validation uses it, and algorithms sit below evaluation)."""

from nemo_like.algorithms.pass_at_k import correct_counts, mean_pass_at_k, pass_at_k

__all__ = ["correct_counts", "mean_pass_at_k", "pass_at_k"]
