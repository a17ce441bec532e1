"""The one definition of the k1/k2/k3 KL estimators (Schulman, "Approximating KL divergence").

For a token ``x ~ p`` and ``log_ratio = log q(x) - log p(x)`` (``r = exp(log_ratio)``):

* ``k1 = -log r``: unbiased for KL(p || q); single values can be negative;
* ``k2 = (log r)^2 / 2``: biased, >= 0, low variance; its own (pathwise) gradient ``(log p - log q) grad log p``
  has the reverse KL's gradient as its expectation under p, so the loss uses it without the score-function term
  (:data:`PATHWISE_KL_ESTIMATORS`): with that term it would differentiate ``E_p[k2]``, not the KL;
* ``k3 = r - 1 - log r``: unbiased (``E_p[r] = 1``), >= 0; ``expm1`` keeps it >= 0 in fp32 near 0.

The loss uses them for KL(pi_curr || pi_ref) (p = pi_curr, q = pi_ref), the divergence metrics
for KL(pi_gen || pi_train), and the rollout rejection masks for per-sequence mismatch statistics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nemo_like.utils.registry import Registry

KLEstimator = Callable[[torch.Tensor], torch.Tensor]

#: Estimators whose plain gradient already estimates grad KL(p || q) (the loss detaches their importance weight);
#: every other one gets the score-function term, which makes the gradient that of ``E_p[estimator]``.
PATHWISE_KL_ESTIMATORS = frozenset({"k2"})

#: ``loss_fn.reference_policy_kl_type`` names (and ``module:function`` paths for user estimators).
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", "loss_fn.reference_policy_kl_type")


@KL_ESTIMATORS.register("k1")
def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """``-log r``: unbiased, can be negative, high variance when the policies agree."""
    return -log_ratio


@KL_ESTIMATORS.register("k2")
def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """``(log r)^2 / 2``: biased, >= 0."""
    return 0.5 * log_ratio**2


@KL_ESTIMATORS.register("k3")
def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """``r - 1 - log r``: unbiased, >= 0, computed with expm1 for precision near r = 1."""
    return torch.expm1(log_ratio) - log_ratio
