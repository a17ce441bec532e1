"""Evaluation: ``nemo-like eval`` (:mod:`nemo_like.evaluation.run`) and the pass@k estimator
(:mod:`nemo_like.algorithms.pass_at_k`, also importable as :mod:`nemo_like.evaluation.pass_at_k`)."""
