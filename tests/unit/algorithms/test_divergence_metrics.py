"""Divergence estimators: exact expectations, Monte Carlo checks, the seeds' biases, combining.

Every estimator is evaluated on tokens sampled from pi_gen over a small vocabulary, where the
exact divergence can be summed over the whole vocabulary. The Monte Carlo tolerance uses the
*exact* variance of the estimator under pi_gen (also summed over the vocabulary), so "within 5
standard errors" is a real statistical statement, not a self-fitted one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from nemo_like.algorithms import metrics as M
from nemo_like.algorithms.metrics import combine_metric_fragments, combine_optimizer_steps, default_metric_reduction, empty_extremes_as_nan

V = 8
NUM_SEQS, SEQ_LEN = 1000, 101  # column 0 is masked: 100_000 sampled tokens
NUM_TOKENS = NUM_SEQS * (SEQ_LEN - 1)

Dist = tuple[torch.Tensor, torch.Tensor]  # (log pi_gen, log pi_train), float64 [V]


def _distributions(seed: int, scale: float) -> Dist:
    g = torch.Generator().manual_seed(seed)
    gen_logits = scale * torch.randn(V, generator=g, dtype=torch.float64)
    train_logits = scale * torch.randn(V, generator=g, dtype=torch.float64)
    return gen_logits.log_softmax(-1), train_logits.log_softmax(-1)


def _near(seed: int) -> Dist:
    # pi_train is a small perturbation of pi_gen, like a trainer/inference mismatch.
    g = torch.Generator().manual_seed(seed)
    gen_logits = torch.randn(V, generator=g, dtype=torch.float64)
    train_logits = gen_logits + 0.3 * torch.randn(V, generator=g, dtype=torch.float64)
    return gen_logits.log_softmax(-1), train_logits.log_softmax(-1)


CASES: dict[str, Dist] = {
    "near_seed0": _near(0),
    "near_seed1": _near(1),
    "moderate_seed2": _distributions(2, 1.0),
    "far_seed3": _distributions(3, 2.5),
}


# ----------------------------------------------------------------- exact reference divergences


def exact_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> float:
    """KL(P || Q) summed over the vocabulary."""
    return float((log_p.exp() * (log_p - log_q)).sum())


def exact_chi2(log_p: torch.Tensor, log_q: torch.Tensor) -> float:
    """chi^2(P || Q) = sum P^2/Q - 1."""
    return float((2 * log_p - log_q).exp().sum() - 1)


def exact_js(log_p: torch.Tensor, log_q: torch.Tensor) -> float:
    log_m = torch.logaddexp(log_p, log_q) - math.log(2)
    return 0.5 * exact_kl(log_p, log_m) + 0.5 * exact_kl(log_q, log_m)


def exact_moments(estimator: Callable[[torch.Tensor], torch.Tensor], dist: Dist) -> tuple[float, float]:
    """(E_gen[f(log r)], Var_gen[f(log r)]) summed over the vocabulary."""
    log_gen, log_train = dist
    values = estimator(log_train - log_gen)
    probs = log_gen.exp()
    mean = float((probs * values).sum())
    return mean, float((probs * values**2).sum()) - mean**2


# -------------------------------------------------------------------- the seeds' formulas


def seed_policy_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """Seed 000's policy_kl: k3 with the ratio reversed, exp(g - p) - (g - p) - 1."""
    return torch.exp(-log_ratio) + log_ratio - 1


def seed_js(log_ratio: torch.Tensor) -> torch.Tensor:
    """Seed 000's js_divergence: 0.5*k3(p vs M) + 0.5*k3(g vs M) on the sampled token.

    With log_gen = 0 w.l.o.g. (the formula only depends on the ratio): p = log r, g = 0.
    """
    p, g = log_ratio, torch.zeros_like(log_ratio)
    m = torch.log(0.5 * p.exp() + 0.5 * g.exp())
    return 0.5 * (torch.exp(p - m) - (p - m) - 1) + 0.5 * (torch.exp(g - m) - (g - m) - 1)


# --------------------------------------------------------------------- targets per metric

# metric key -> (per-token estimator, exact target as a function of (log_gen, log_train))
TOKEN_METRICS: dict[str, tuple[Callable, Callable[[torch.Tensor, torch.Tensor], float]]] = {
    "gen_kl": (M.kl_gen_train_k3, lambda lg, lt: exact_kl(lg, lt)),
    "rollout_corr/kl": (M.kl_gen_train_k1, lambda lg, lt: exact_kl(lg, lt)),
    "rollout_corr/k3_kl": (M.kl_gen_train_k3, lambda lg, lt: exact_kl(lg, lt)),
    "policy_kl": (M.kl_train_gen, lambda lg, lt: exact_kl(lt, lg)),
    "js_divergence": (M.js_divergence, lambda lg, lt: exact_js(lg, lt)),
    "rollout_corr/chi2_token": (M.chi2_train_gen, lambda lg, lt: exact_chi2(lt, lg)),
}


def _sample_batch(dist: Dist, seed: int) -> dict[str, torch.Tensor]:
    """Token ids ~ pi_gen laid out as [NUM_SEQS, SEQ_LEN] with their logprobs and masks."""
    log_gen, log_train = dist
    g = torch.Generator().manual_seed(seed)
    ids = torch.multinomial(log_gen.exp(), NUM_SEQS * SEQ_LEN, replacement=True, generator=g)
    ids = ids.view(NUM_SEQS, SEQ_LEN)
    token_mask = torch.ones(NUM_SEQS, SEQ_LEN)
    token_mask[:, 0] = 0
    return {
        "train": log_train[ids],
        "gen": log_gen[ids],
        "token_mask": token_mask,
        "sample_mask": torch.ones(NUM_SEQS),
    }


@pytest.fixture(scope="module")
def sampled_fragments() -> dict[str, dict[str, float]]:
    out = {}
    for i, (name, dist) in enumerate(CASES.items()):
        b = _sample_batch(dist, seed=100 + i)
        frags = M.divergence_metric_fragments(b["train"], b["gen"], b["token_mask"], b["sample_mask"], NUM_TOKENS, NUM_SEQS)
        out[name] = {k: float(v) for k, v in frags.items()}
    return out


def test_far_case_is_really_far() -> None:
    log_gen, log_train = CASES["far_seed3"]
    assert exact_kl(log_gen, log_train) > 1.0
    assert exact_kl(log_train, log_gen) > 1.0


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("metric", list(TOKEN_METRICS))
def test_estimator_expectation_is_exact_divergence(case: str, metric: str) -> None:
    """Summed over the vocabulary, E_gen[estimator] equals the divergence (unbiasedness)."""
    estimator, target = TOKEN_METRICS[metric]
    log_gen, log_train = CASES[case]
    mean, _ = exact_moments(estimator, CASES[case])
    assert mean == pytest.approx(target(log_gen, log_train), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("metric", list(TOKEN_METRICS))
def test_monte_carlo_metric_matches_exact_divergence(case: str, metric: str, sampled_fragments: dict[str, dict[str, float]]) -> None:
    """The metric computed by divergence_metric_fragments on pi_gen samples is within 5 SE."""
    estimator, target = TOKEN_METRICS[metric]
    log_gen, log_train = CASES[case]
    _, variance = exact_moments(estimator, CASES[case])
    standard_error = math.sqrt(variance / NUM_TOKENS)
    observed = sampled_fragments[case][metric]
    assert abs(observed - target(log_gen, log_train)) < 5 * standard_error + 1e-12


def test_k3_with_the_reversed_ratio_estimates_chi2_minus_kl_not_kl_train_gen(
    sampled_fragments: dict[str, dict[str, float]],
) -> None:
    """The reversed-ratio k3 (seed 000's policy_kl) has expectation chi^2(gen||train) - KL(gen||train), for every case,
    and on the far case that is many standard errors away from KL(train||gen)."""
    for log_gen, log_train in CASES.values():
        mean, _ = exact_moments(seed_policy_kl, (log_gen, log_train))
        expected = exact_chi2(log_gen, log_train) - exact_kl(log_gen, log_train)
        assert mean == pytest.approx(expected, rel=1e-9)

    dist = CASES["far_seed3"]
    log_gen, log_train = dist
    b = _sample_batch(dist, seed=7)
    mask = b["token_mask"].bool()
    values = seed_policy_kl(b["train"] - b["gen"])[mask]
    mc_mean = float(values.mean())
    _, variance = exact_moments(seed_policy_kl, dist)
    standard_error = math.sqrt(variance / NUM_TOKENS)
    chi2_minus_kl = exact_chi2(log_gen, log_train) - exact_kl(log_gen, log_train)
    assert abs(mc_mean - chi2_minus_kl) < 5 * standard_error
    assert abs(mc_mean - exact_kl(log_train, log_gen)) > 50 * standard_error
    # ... while our estimator lands on KL(train || gen) (checked above) on the same case.


def test_plug_in_js_formula_estimates_half_kl_minus_kl_to_mixture_not_js() -> None:
    """Seed 000's js_divergence has expectation 0.5 KL(gen||train) - KL(gen||M), not JS; on the
    far case it even exceeds JS's upper bound log 2."""
    for log_gen, log_train in CASES.values():
        log_m = torch.logaddexp(log_gen, log_train) - math.log(2)
        mean, _ = exact_moments(seed_js, (log_gen, log_train))
        expected = 0.5 * exact_kl(log_gen, log_train) - exact_kl(log_gen, log_m)
        assert mean == pytest.approx(expected, rel=1e-9, abs=1e-12)
    log_gen, log_train = CASES["far_seed3"]
    seed_mean, _ = exact_moments(seed_js, CASES["far_seed3"])
    assert seed_mean > math.log(2) > exact_js(log_gen, log_train)


def test_k3_with_the_reversed_ratio_is_neither_kl_direction_on_a_far_case() -> None:
    """The reviewer of seed 001 claimed E_gen[r - log r - 1] is KL(train||gen) and proposed the
    reversed ratio. It is KL(gen||train) (shown above); the reversed form is seed 000's biased
    policy_kl, which on the far case is neither KL."""
    log_gen, log_train = CASES["far_seed3"]
    flipped, _ = exact_moments(seed_policy_kl, CASES["far_seed3"])
    for target in (exact_kl(log_gen, log_train), exact_kl(log_train, log_gen)):
        assert abs(flipped - target) > 0.1 * target


def test_chi2_seq_product_form_is_sequence_level_chi2() -> None:
    """For i.i.d. tokens, E_gen[prod_t r_t^2] - 1 = (1 + chi2_token)^T - 1: checked by MC."""
    dist = CASES["near_seed1"]
    log_gen, log_train = dist
    seq_len = 4  # 3 valid tokens after the masked position 0
    g = torch.Generator().manual_seed(11)
    num_seqs = 50_000
    ids = torch.multinomial(log_gen.exp(), num_seqs * seq_len, replacement=True, generator=g)
    ids = ids.view(num_seqs, seq_len)
    token_mask = torch.ones(num_seqs, seq_len)
    token_mask[:, 0] = 0
    frags = M.divergence_metric_fragments(log_train[ids], log_gen[ids], token_mask, torch.ones(num_seqs), token_mask.sum(), num_seqs)
    chi2_token = exact_chi2(log_train, log_gen)
    target = (1 + chi2_token) ** 3 - 1
    # Exact variance of prod r^2 over 3 i.i.d. tokens: E[r^4]^3 - E[r^2]^6.
    probs, r = log_gen.exp(), (log_train - log_gen).exp()
    m2, m4 = float((probs * r**2).sum()), float((probs * r**4).sum())
    standard_error = math.sqrt((m4**3 - m2**6) / num_seqs)
    assert abs(float(frags["rollout_corr/chi2_seq"]) - target) < 5 * standard_error


def test_per_token_estimators_are_nonnegative_and_zero_at_equal_policies() -> None:
    log_ratio = torch.linspace(-30, 30, 2001, dtype=torch.float64)
    for fn in (M.kl_gen_train_k3, M.kl_train_gen, M.js_divergence):
        assert bool((fn(log_ratio) >= 0).all()), fn.__name__
        assert float(fn(torch.zeros((), dtype=torch.float64))) == 0.0
    assert bool((M.chi2_train_gen(log_ratio) >= -1).all())
    assert bool((M.mult_prob_error(log_ratio) >= 1).all())


def test_js_expectation_is_bounded_by_log2() -> None:
    for dist in CASES.values():
        mean, _ = exact_moments(M.js_divergence, dist)
        assert 0 <= mean <= math.log(2)


def test_worked_example_from_the_guide() -> None:
    """logp_gen = -5, logp_train = -15 (log r = -10): the numbers quoted in docs/guides/grpo.md."""
    log_ratio = torch.tensor(-10.0, dtype=torch.float64)
    r = math.exp(-10)
    assert float(M.kl_gen_train_k3(log_ratio)) == pytest.approx(9.0 + r, rel=1e-12)  # 9.0000454
    assert float(M.kl_gen_train_k1(log_ratio)) == pytest.approx(10.0)
    assert float(M.kl_train_gen(log_ratio)) == pytest.approx(1 - 11 * r, rel=1e-12)  # 0.9995006
    assert float(M.js_divergence(log_ratio)) == pytest.approx(0.3463396245676546, rel=1e-12)
    assert float(M.chi2_train_gen(log_ratio)) == pytest.approx(r * r - 1, rel=1e-12)
    assert float(M.mult_prob_error(log_ratio)) == pytest.approx(math.exp(10), rel=1e-12)
    assert float(seed_policy_kl(log_ratio)) == pytest.approx(math.exp(10) - 11, rel=1e-12)  # 22015.47
    assert float(seed_js(log_ratio)) == pytest.approx(math.log((1 + r) / (2 * math.sqrt(r))), rel=1e-12)  # 4.3069 > log 2


def test_sequence_metrics_by_hand() -> None:
    """Two sequences; the second has sample_mask 0 and must not count."""
    train = torch.tensor([[0.0, math.log(0.5), math.log(0.25)], [0.0, -9.0, -9.0]])
    gen = torch.tensor([[0.0, math.log(0.25), math.log(0.5)], [0.0, -1.0, -1.0]])
    token_mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    frags = M.divergence_metric_fragments(train, gen, token_mask, torch.tensor([1.0, 0.0]), 2, 1)
    # log r = [log 2, -log 2]: product 1 -> chi2_seq 0; geometric mean 1 -> 0.
    assert float(frags["rollout_corr/chi2_seq"]) == pytest.approx(0.0, abs=1e-12)
    assert float(frags["rollout_corr/chi2_seq_geomean"]) == pytest.approx(0.0, abs=1e-12)
    # training ppl: exp(-(log .5 + log .25)/2) = exp(1.5 log 2) = 2^1.5; same for the rollout.
    assert float(frags["rollout_corr/training_ppl"]) == pytest.approx(2**1.5)
    assert float(frags["rollout_corr/rollout_ppl"]) == pytest.approx(2**1.5)
    # chi2_token: ((2^2 - 1) + (0.5^2 - 1)) / 2 = (3 - 0.75)/2 = 1.125
    assert float(frags["rollout_corr/chi2_token"]) == pytest.approx(1.125)
    # ESS fraction: mean(r)^2 / mean(r^2) = 1.25^2 / 2.125
    combined = combine_metric_fragments([{k: float(v) for k, v in frags.items()}], default_metric_reduction)
    assert combined["rollout_corr/is_eff_sample_size"] == pytest.approx(1.25**2 / 2.125)
    # token_mult_prob_error: exp(|log 2|) for both tokens
    assert float(frags["token_mult_prob_error"]) == pytest.approx(2.0)
    # The batch above is symmetric (equal perplexities, mean log-ratio 0): swapped perplexities or any factor in the
    # geometric mean's exponent passed it. train [.5, .5], gen [.25, .25]: log r = log 2 on both tokens.
    train, gen = torch.tensor([[0.0, math.log(0.5), math.log(0.5)]]), torch.tensor([[0.0, math.log(0.25), math.log(0.25)]])
    frags = M.divergence_metric_fragments(train, gen, torch.tensor([[0.0, 1.0, 1.0]]), torch.tensor([1.0]), 2, 1)
    assert float(frags["rollout_corr/training_ppl"]) == pytest.approx(2.0)
    assert float(frags["rollout_corr/rollout_ppl"]) == pytest.approx(4.0)
    assert float(frags["rollout_corr/chi2_seq_geomean"]) == pytest.approx(3.0)  # r^2 - 1 with r the geometric mean, 2
    assert float(frags["rollout_corr/chi2_seq"]) == pytest.approx(15.0)  # (2 * 2)^2 - 1


@pytest.mark.parametrize("case", ["near_seed0", "far_seed3"])
def test_approx_entropy_estimates_the_entropy_of_pi_curr(case: str) -> None:
    """train/approx_entropy, E_gen[(pi_curr / pi_gen) (-log pi_curr)], is H(pi_curr): exactly over the vocabulary, and
    within 5 standard errors from ClippedPGLossFn on pi_gen samples (it was only compared with itself across
    micro-batches: any estimator passed); one token by hand."""
    from nemo_like.algorithms.loss_functions import ClippedPGLossFn

    log_gen, log_curr = CASES[case]
    entropy = float(-(log_curr.exp() * log_curr).sum())
    mean, variance = exact_moments(lambda log_ratio: -log_ratio.exp() * (log_gen + log_ratio), (log_gen, log_curr))
    assert mean == pytest.approx(entropy, rel=1e-9)

    def approx_entropy(curr: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor) -> float:
        data = {"advantages": torch.zeros_like(curr), "token_mask": mask, "sample_mask": torch.ones(curr.shape[0]),
                "generation_logprobs": gen, "prev_logprobs": curr}  # fmt: skip
        _, metrics = ClippedPGLossFn({})(curr.clone().requires_grad_(True), data, float(curr.shape[0]), float(mask.sum()))
        return metrics["approx_entropy"]

    b = _sample_batch((log_gen, log_curr), seed=11)
    observed = approx_entropy(b["train"], b["gen"], b["token_mask"])
    assert abs(observed - entropy) < 5 * math.sqrt(variance / NUM_TOKENS)
    one = approx_entropy(torch.tensor([[0.0, math.log(0.5)]]), torch.tensor([[0.0, math.log(0.25)]]), torch.tensor([[0.0, 1.0]]))
    assert one == pytest.approx(2 * math.log(2))  # (0.5 / 0.25) * -log 0.5


# -------------------------------------------------------------------------- combining


def test_combine_sums_min_max_and_recomputes_derived_metrics() -> None:
    a = {
        "x": 1.0,
        "r_min": 0.5,
        "r_max": 2.0,
        "rollout_corr/is_weight_mean": 0.4,
        "rollout_corr/is_weight_sq_mean": 0.3,
        "rollout_corr/is_eff_sample_size": 123.0,
    }
    b = {"x": 2.0, "r_min": math.inf, "r_max": -math.inf, "rollout_corr/is_weight_mean": 0.6, "rollout_corr/is_weight_sq_mean": 0.9}
    out = combine_metric_fragments([a, b], default_metric_reduction)
    assert out["x"] == 3.0
    assert out["r_min"] == 0.5 and out["r_max"] == 2.0
    assert out["rollout_corr/is_eff_sample_size"] == pytest.approx(1.0 / 1.2)


def test_combine_is_associative_and_reports_empty_min_as_nan() -> None:
    frags = [{"v": 1.0, "v_min": math.inf}, {"v": 2.0, "v_min": math.inf}, {"v": 4.0, "v_min": 3.0}]
    flat = combine_metric_fragments(frags, default_metric_reduction)
    nested = combine_metric_fragments(
        [combine_metric_fragments(frags[:2], default_metric_reduction), combine_metric_fragments(frags[2:], default_metric_reduction)],
        default_metric_reduction,
    )
    assert flat == nested == {"v": 7.0, "v_min": 3.0}
    empty = combine_metric_fragments(frags[:2], default_metric_reduction)
    assert empty["v_min"] == math.inf  # the identity while combining; as logged, NaN
    assert math.isnan(empty_extremes_as_nan(empty)["v_min"]) and empty_extremes_as_nan(flat) == flat


def test_a_non_finite_micro_batch_makes_its_extremes_nan_at_every_level() -> None:
    """A NaN fragment was dropped as if it were the "no valid token" marker: the logged max came from the finite
    micro-batches while the loss was NaN."""
    finite, broken, empty = {"r_max": 1.1, "r_min": 1.0}, {"r_max": math.nan, "r_min": math.nan}, {"r_max": -math.inf, "r_min": math.inf}
    step = combine_metric_fragments([finite, broken], default_metric_reduction)
    assert math.isnan(step["r_max"]) and math.isnan(step["r_min"])
    ranks = combine_metric_fragments([step, combine_metric_fragments([empty], default_metric_reduction)], default_metric_reduction)
    assert math.isnan(ranks["r_max"])
    for steps in ([step, {"r_max": 2.0, "r_min": 0.5}], [{"r_max": 2.0, "r_min": 0.5}, step]):  # either order
        combined = combine_optimizer_steps(steps, default_metric_reduction)
        assert math.isnan(combined["r_max"]) and math.isnan(combined["r_min"]), steps


def test_derived_metrics_have_no_reduction_and_bad_reductions_are_rejected() -> None:
    with pytest.raises(ValueError, match="derived"):
        default_metric_reduction("rollout_corr/is_eff_sample_size")
    with pytest.raises(ValueError, match="unknown reduction"):
        combine_metric_fragments([{"x": 1.0}], lambda name: "mean")
