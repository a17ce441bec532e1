"""ClippedPGLossFn: hand-derived values and gradients per option, masking, microbatch contract.

Layout of the hand-built batches: position 0 of every row is the prompt (masked), the response
tokens follow. Unless stated otherwise prev = gen, so importance weights are 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_like.algorithms.loss_functions import ClippedPGLossFn, combine_metric_fragments, exp_limit
from nemo_like.config.loss import ClippedPGLossConfig

LOG = math.log


def _batch(
    curr: list[list[float]],
    advantages: list[list[float]],
    prev: list[list[float]] | None = None,
    gen: list[list[float]] | None = None,
    ref: list[list[float]] | None = None,
    token_mask: list[list[float]] | None = None,
    sample_mask: list[float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rows of response-token values; a masked prompt position 0 is prepended to each row."""

    def tensor(rows: list[list[float]]) -> torch.Tensor:
        return torch.tensor([[0.0, *row] for row in rows], dtype=torch.float64)

    curr_t = tensor(curr).requires_grad_(True)
    mask = tensor(token_mask) if token_mask else tensor([[1.0] * len(r) for r in curr])
    mask[:, 0] = 0
    data = {
        "advantages": tensor(advantages),
        "token_mask": mask,
        "sample_mask": torch.tensor(sample_mask or [1.0] * len(curr), dtype=torch.float64),
        "generation_logprobs": tensor(gen) if gen else tensor(prev or curr).detach(),
    }
    if prev is not None:
        data["prev_logprobs"] = tensor(prev)
    if ref is not None:
        data["reference_policy_logprobs"] = tensor(ref)
    return curr_t, data


def _run(
    cfg: ClippedPGLossConfig, curr: torch.Tensor, data: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """Full-batch call with the global counts of this batch; returns loss, metrics, d loss/d curr."""
    mask = data["token_mask"] * data["sample_mask"][:, None]
    fn = ClippedPGLossFn(cfg)
    loss, fragments = fn(curr, data, data["sample_mask"].sum(), mask.sum())
    (grad,) = torch.autograd.grad(loss, curr)
    return loss.detach(), combine_metric_fragments([fragments], fn.metric_reduction), grad[:, 1:]


def _grad(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# ---------------------------------------------------------------- PPO clipping

# prev = log 0.5 everywhere; curr = log(0.5 r) gives ratios r = [1.5, 0.5, 1.25, 0.5].
RATIOS = [1.5, 0.5, 1.25, 0.5]
PPO_CURR = [[LOG(0.5 * r) for r in RATIOS]]
PPO_PREV = [[LOG(0.5)] * 4]
PPO_ADV = [[1.0, -1.0, 2.0, 1.0]]


def test_ppo_symmetric_clip_values_and_gradients() -> None:
    # eps = 0.2, band [0.8, 1.2]; per-token loss = max(-A r, -A clamp(r)):
    #   t1 A=+1 r=1.5:  max(-1.5, -1.2) = -1.2  clipped -> grad 0
    #   t2 A=-1 r=0.5:  max( 0.5,  0.8) =  0.8  clipped -> grad 0
    #   t3 A=+2 r=1.25: max(-2.5, -2.4) = -2.4  clipped -> grad 0
    #   t4 A=+1 r=0.5:  max(-0.5, -0.8) = -0.5  unclipped -> d/dlogp(-A r) = -A r = -0.5
    # loss = (-1.2 + 0.8 - 2.4 - 0.5) / 4 = -0.825 ; grad / 4 tokens.
    curr, data = _batch(PPO_CURR, PPO_ADV, prev=PPO_PREV)
    loss, m, grad = _run(ClippedPGLossConfig(), curr, data)
    assert float(loss) == pytest.approx(-0.825)
    torch.testing.assert_close(grad, _grad([[0.0, 0.0, 0.0, -0.5 / 4]]))
    assert m["clip_fraction"] == pytest.approx(0.75)
    assert m["probs_ratio"] == pytest.approx(sum(RATIOS) / 4)  # 0.9375
    assert m["probs_ratio_clamped"] == pytest.approx((1.2 + 0.8 + 1.2 + 0.8) / 4)
    assert m["probs_ratio_min"] == pytest.approx(0.5) and m["probs_ratio_max"] == pytest.approx(1.5)
    assert m["probs_ratio_clamped_min"] == pytest.approx(0.8)
    assert m["probs_ratio_clamped_max"] == pytest.approx(1.2)


def test_ppo_asymmetric_clip_higher() -> None:
    # band [0.9, 1.3]: t1 -> -1.3 (clipped), t2 -> max(0.5, 0.9) = 0.9 (clipped),
    # t3 r=1.25 inside -> -2.5 with grad -A r = -2.5, t4 -> -0.5 with grad -0.5.
    # loss = (-1.3 + 0.9 - 2.5 - 0.5) / 4 = -0.85
    curr, data = _batch(PPO_CURR, PPO_ADV, prev=PPO_PREV)
    cfg = ClippedPGLossConfig(ratio_clip_min=0.1, ratio_clip_max=0.3)
    loss, m, grad = _run(cfg, curr, data)
    assert float(loss) == pytest.approx(-0.85)
    torch.testing.assert_close(grad, _grad([[0.0, 0.0, -2.5 / 4, -0.5 / 4]]))
    assert m["clip_fraction"] == pytest.approx(0.5)


def test_dual_clip_caps_negative_advantage_loss() -> None:
    # prev = log 0.1; ratios [5, 2], A = [-1, -1], c = 3.
    #   t1: PPO max(5, 1.2) = 5, dual min(5, 3) = 3 -> grad 0
    #   t2: PPO max(2, 1.2) = 2 < 3 -> 2, grad -A r = 2
    # loss = (3 + 2) / 2 = 2.5
    curr, data = _batch([[LOG(0.5), LOG(0.2)]], [[-1.0, -1.0]], prev=[[LOG(0.1)] * 2])
    loss, m, grad = _run(ClippedPGLossConfig(ratio_clip_c=3.0), curr, data)
    assert float(loss) == pytest.approx(2.5)
    torch.testing.assert_close(grad, _grad([[0.0, 2.0 / 2]]))
    assert m["clip_fraction"] == pytest.approx(0.5)
    # Without dual clip the first token would contribute 5: loss (5 + 2)/2.
    curr, data = _batch([[LOG(0.5), LOG(0.2)]], [[-1.0, -1.0]], prev=[[LOG(0.1)] * 2])
    loss_plain, _, _ = _run(ClippedPGLossConfig(), curr, data)
    assert float(loss_plain) == pytest.approx(3.5)


# ---------------------------------------------------------------- other surrogates


def test_cispo_keeps_bounded_gradient_on_clipped_tokens() -> None:
    # r = [1.5, 0.5] (prev = log 0.5), A = [1, -1]; per-token -A * sg(clamp r) * logp:
    #   t1: -1 * 1.2 * log .75 ; t2: +1 * 0.8 * log .25
    # loss = (-1.2 log .75 + 0.8 log .25)/2 ; grads -A clamp(r)/2 = [-0.6, +0.4]
    curr, data = _batch([[LOG(0.75), LOG(0.25)]], [[1.0, -1.0]], prev=[[LOG(0.5)] * 2])
    loss, m, grad = _run(ClippedPGLossConfig(use_cispo=True), curr, data)
    assert float(loss) == pytest.approx((-1.2 * LOG(0.75) + 0.8 * LOG(0.25)) / 2)  # -0.381909
    torch.testing.assert_close(grad, _grad([[-0.6, 0.4]]))
    assert m["clip_fraction"] == pytest.approx(1.0)


def test_at_a_ratio_of_one_every_built_in_surrogate_has_ppos_gradient() -> None:
    """What the one-step-per-rollout warnings claim (config/loss.py): with the prev pass skipped, pi_prev is pi_curr
    detached, and PPO-clip, unclipped, CISPO and REINFORCE all give -A d log pi / N (A = [1, -1, 2, 0.5], N = 4); only
    the loss value differs (-mean A r = -mean A for the ratio surrogates, -mean A log pi for REINFORCE and CISPO)."""
    curr_values, advantages = [[LOG(0.3), LOG(0.6), LOG(0.9), LOG(0.2)]], [[1.0, -1.0, 2.0, 0.5]]
    expected = _grad([[-1.0 / 4, 1.0 / 4, -2.0 / 4, -0.5 / 4]])
    for options in ({}, {"surrogate": "unclipped"}, {"use_cispo": True}, {"disable_ppo_ratio": True}, {"ratio_clip_c": 3.0}):
        curr, data = _batch(curr_values, advantages)  # no prev: the skipped pass, pi_prev = pi_curr detached
        loss, _, grad = _run(ClippedPGLossConfig(**options), curr, data)
        torch.testing.assert_close(grad, expected, msg=str(options))
        reinforce_like = options.get("use_cispo") or options.get("disable_ppo_ratio")
        logp = sum(a * c for a, c in zip(advantages[0], curr_values[0]))
        assert float(loss) == pytest.approx(-(logp if reinforce_like else sum(advantages[0])) / 4), options


def test_disable_ppo_ratio_is_reinforce() -> None:
    # loss = mean(-A logp) = -(2 log .5 - 1 log .25)/2 = 0 ; grad -A/2 = [-1, 0.5]
    curr, data = _batch([[LOG(0.5), LOG(0.25)]], [[2.0, -1.0]], prev=[[LOG(0.1)] * 2])
    loss, m, grad = _run(ClippedPGLossConfig(disable_ppo_ratio=True), curr, data)
    assert float(loss) == pytest.approx(-(2 * LOG(0.5) - LOG(0.25)) / 2)
    torch.testing.assert_close(grad, _grad([[-1.0, 0.5]]))
    assert m["clip_fraction"] == 0.0
    assert m["probs_ratio"] == pytest.approx((5.0 + 2.5) / 2)  # reported, not used


@pytest.mark.parametrize("drop_prev", [False, True])
def test_force_on_policy_ratio_and_missing_prev(drop_prev: bool) -> None:
    # ratio exp(c - sg c) = 1 whatever prev says: loss = mean(-A) = -(2 - 1)/2, grad -A/2
    curr, data = _batch([[LOG(0.5), LOG(0.25)]], [[2.0, -1.0]], prev=[[LOG(0.1)] * 2], gen=[[LOG(0.5), LOG(0.25)]])
    cfg = ClippedPGLossConfig()
    if drop_prev:
        del data["prev_logprobs"]
    else:
        cfg = ClippedPGLossConfig(force_on_policy_ratio=True)
    loss, m, grad = _run(cfg, curr, data)
    assert float(loss) == pytest.approx(-0.5)
    torch.testing.assert_close(grad, _grad([[-1.0, 0.5]]))
    assert m["probs_ratio"] == pytest.approx(1.0)
    # Divergence metrics compare generation against the *current* logprobs (here equal).
    assert m["gen_kl"] == pytest.approx(0.0)


# ---------------------------------------------------------------- importance sampling

# curr = prev (r = 1); prev - gen = [log 2, log 0.8] -> weights [2, 0.8]; A = [1, 1].
IS_PREV = [[LOG(0.5), LOG(0.4)]]
IS_GEN = [[LOG(0.25), LOG(0.5)]]


def _is_batch() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return _batch(IS_PREV, [[1.0, 1.0]], prev=IS_PREV, gen=IS_GEN)


@pytest.mark.parametrize("surrogate", ["ppo_clip", "unclipped", "cispo", "icepop"])
@pytest.mark.parametrize("advantage", [1.0, -1.0, 3.75, -3.75])  # |A| > e: -A r overflowed again at exp's edge
@pytest.mark.parametrize("gap", [87.5, 90.0])  # just inside exp's float32 range (-A r overflowed), past it (r did)
def test_a_ratio_past_exps_range_gets_no_gradient_and_leaves_the_others_finite(surrogate: str, advantage: float, gap: float) -> None:
    """log(pi_curr / pi_prev) = 90 on one token: exp is inf in float32, and its zero gradient where clipped (or its
    importance weight of 0) times inf was a NaN gradient for the whole step; with A < 0 an inf loss (NaN with icepop).
    At 87.5 exp is finite, but -A r overflowed for |A| > 1.3: the step was skipped where 90 trained."""
    options = {
        "ppo_clip": {},
        "unclipped": {"trust_region_type": "dppo_binary_tv"},
        "cispo": {"use_cispo": True},
        "icepop": {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
                   "truncated_importance_sampling_ratio": 2.0, "truncated_importance_sampling_ratio_min": 0.5},
    }[surrogate]  # fmt: skip
    prev = torch.tensor([[-1.0, -2.0, -95.0]])
    curr = (prev + torch.tensor([[0.0, 0.0, gap]])).requires_grad_(True)
    data = dict(prev_logprobs=prev, generation_logprobs=torch.tensor([[-1.0, -2.0, -3.0]]), advantages=torch.full((1, 3), advantage),
                token_mask=torch.ones(1, 3), sample_mask=torch.ones(1))  # fmt: skip
    loss, metrics = ClippedPGLossFn(options)(curr, data, 1, 3)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(curr.grad).all()
    held = math.exp(exp_limit(torch.float32) - math.log(3))  # the dtype's largest value over e and the 3 tokens
    assert metrics["probs_ratio_max"] == pytest.approx(held, rel=1e-6)  # held: reported as huge, finite
    assert (curr.grad[0, :2] != 0).all()  # the other tokens still train
    if surrogate != "cispo":  # CISPO's clipped token keeps its bounded gradient -A clamp(r) (by design)
        assert curr.grad[0, 2] == 0.0


@pytest.mark.parametrize(
    ("options", "weights", "oob"),
    [
        ({"use_importance_sampling_correction": False}, [1.0, 1.0], 0.0),
        ({}, [2.0, 0.8], 0.0),
        # tis clamps to [0, 1.5]: [1.5, 0.8]
        ({"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.5}, [1.5, 0.8], 0.5),
        # icepop zeroes outside [0.5, 1.5]: [0, 0.8]
        (
            {
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 1.5,
                "truncated_importance_sampling_ratio_min": 0.5,
            },
            [0.0, 0.8],
            0.5,
        ),
        # seq-mask-tis: geometric mean sqrt(2 * 0.8) = 1.265 in [0.5, 1.5] -> sequence kept
        (
            {
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 1.5,
                "truncated_importance_sampling_ratio_min": 0.5,
            },
            [2.0, 0.8],
            0.0,
        ),
        # ... and with max 1.2 the whole sequence is dropped (1 of 1 sequences out of bounds)
        (
            {
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 1.2,
                "truncated_importance_sampling_ratio_min": 0.5,
            },
            [0.0, 0.0],
            1.0,
        ),
    ],
)
def test_importance_sampling_correction_and_truncation(options: dict, weights: list[float], oob: float) -> None:
    # r = 1 and A = 1, so per-token loss = -w and d/dlogp = -w (over 2 tokens).
    cfg = ClippedPGLossConfig(**{"use_importance_sampling_correction": True, **options})
    loss, m, grad = _run(cfg, *_is_batch())
    assert float(loss) == pytest.approx(-sum(weights) / 2)
    torch.testing.assert_close(grad, _grad([[-w / 2 for w in weights]]))
    assert m["sampling_importance_ratio_untruncated"] == pytest.approx(1.4)
    if cfg.use_importance_sampling_correction:
        assert m["sampling_importance_ratio"] == pytest.approx(sum(weights) / 2)
    assert m["is_oob_ratio"] == pytest.approx(oob)


def test_gspo_sequence_level_ratio_and_loss() -> None:
    # Row 1: c - p = [log 2, log .5] -> seq ratio exp(mean) = 1, A = 1 -> seq loss -1;
    #        d/dc_t = -A r / T / N_seq = -1 * 1 / 2 / 2 = -0.25 each.
    # Row 2: one token, c - p = log 1.5 -> r = 1.5 clipped to 1.2 -> seq loss -1.2, grad 0.
    # loss = (-1 - 1.2)/2 = -1.1
    curr, data = _batch(
        [[LOG(0.5), LOG(0.125)], [LOG(0.75), 0.0]],
        [[1.0, 1.0], [1.0, 0.0]],
        prev=[[LOG(0.25), LOG(0.25)], [LOG(0.5), 0.0]],
        token_mask=[[1, 1], [1, 0]],
    )
    cfg = ClippedPGLossConfig(sequence_level_importance_ratios=True, token_level_loss=False)
    loss, m, grad = _run(cfg, curr, data)
    assert float(loss) == pytest.approx(-1.1)
    torch.testing.assert_close(grad, _grad([[-0.25, -0.25], [0.0, 0.0]]))
    # probs_ratio is a token mean of the broadcast sequence ratios: (1 + 1 + 1.5)/3
    assert m["probs_ratio"] == pytest.approx(3.5 / 3)


def test_gspo_importance_weights_are_sequence_products() -> None:
    # prev - gen = [log 2, log .8] in one sequence: weight 1.6 for the whole sequence.
    curr, data = _is_batch()
    cfg = ClippedPGLossConfig(
        sequence_level_importance_ratios=True,
        token_level_loss=False,
        use_importance_sampling_correction=True,
    )
    loss, m, _ = _run(cfg, curr, data)
    assert float(loss) == pytest.approx(-1.6)
    assert m["sampling_importance_ratio"] == pytest.approx(1.6)


def test_held_ratios_and_overflowing_weights_read_as_huge_finite_means() -> None:
    """Two held tokens made probs_ratio inf (each reported at float32's largest value, and their mean overflowed); a
    sequence weight past exp's range, dropped by the loss, read as 0 in sampling_importance_ratio_untruncated (0.5
    here: a healthy mean, hiding it)."""
    prev = torch.tensor([[-95.0, -95.0, -1.0]])
    curr = (prev + torch.tensor([[90.0, 90.0, 0.0]])).requires_grad_(True)
    data = dict(prev_logprobs=prev, generation_logprobs=prev, advantages=torch.ones(1, 3), token_mask=torch.ones(1, 3),
                sample_mask=torch.ones(1))  # fmt: skip
    loss, metrics = ClippedPGLossFn({})(curr, data, 1, 3)
    held = math.exp(exp_limit(torch.float32) - math.log(3))
    assert math.isfinite(loss.item()) and metrics["probs_ratio"] == pytest.approx((2 * held + 1) / 3, rel=1e-5)
    gen = torch.tensor([[-1.0, -1.0], [-95.0, -1.0]])  # row 2: log(prev / gen) sums to 94 nats, exp's float32 limit ~88.7
    curr = torch.full((2, 2), -1.0, requires_grad=True)
    data = dict(prev_logprobs=curr.detach().clone(), generation_logprobs=gen, advantages=torch.ones(2, 2),
                token_mask=torch.ones(2, 2), sample_mask=torch.ones(2))  # fmt: skip
    cfg = {"sequence_level_importance_ratios": True, "token_level_loss": False, "use_importance_sampling_correction": True}
    loss, metrics = ClippedPGLossFn(cfg)(curr, data, 2, 4)
    assert loss.item() == pytest.approx(-0.5)  # the overflowing sequence is dropped (weight 0); the other trains
    huge = math.exp(exp_limit(torch.float32) - math.log(4))  # held over the micro-batch's 4 tokens
    assert metrics["sampling_importance_ratio_untruncated"] == pytest.approx((1 + huge) / 2, rel=1e-5)


def test_token_versus_sequence_level_normalisation() -> None:
    # on-policy (r = 1), per-token loss = -A. Row 1: one token A = 4; row 2: three tokens A = 1.
    # token level: -(4 + 3)/4 = -1.75 ; sequence level: -(4 + 1)/2 = -2.5
    curr, data = _batch([[-1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]], [[4.0, 0.0, 0.0], [1.0, 1.0, 1.0]], token_mask=[[1, 0, 0], [1, 1, 1]])
    token_loss, _, _ = _run(ClippedPGLossConfig(), curr, data)
    seq_loss, _, grad = _run(ClippedPGLossConfig(token_level_loss=False), curr, data)
    assert float(token_loss) == pytest.approx(-1.75)
    assert float(seq_loss) == pytest.approx(-2.5)
    torch.testing.assert_close(grad, _grad([[-4 / 2, 0, 0], [-1 / 6, -1 / 6, -1 / 6]]))


# ---------------------------------------------------------------- reference KL

# A = 0 so only the KL term remains; ref - curr = [log 2, log .5].
KL_CURR = [[LOG(0.25), LOG(0.5)]]
KL_REF = [[LOG(0.5), LOG(0.25)]]


def _kl_batch(gen: list[list[float]] | None = None):
    return _batch(KL_CURR, [[0.0, 0.0]], ref=KL_REF, gen=gen)


@pytest.mark.parametrize(
    ("kl_type", "per_token"),
    [
        # k1 = -log(ref/curr): [-log 2, log 2] -> mean 0
        ("k1", [-LOG(2), LOG(2)]),
        # k2 = log^2/2: both 0.5 log(2)^2 = 0.240227
        ("k2", [0.5 * LOG(2) ** 2] * 2),
        # k3 = e^x - 1 - x: [2 - 1 - log 2, 0.5 - 1 + log 2] = [0.306853, 0.193147]
        ("k3", [1 - LOG(2), LOG(2) - 0.5]),
    ],
)
def test_reference_kl_estimators(kl_type: str, per_token: list[float]) -> None:
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.1, reference_policy_kl_type=kl_type)
    loss, m, grad = _run(cfg, *_kl_batch())
    assert m["kl_penalty"] == pytest.approx(sum(per_token) / 2)
    assert float(loss) == pytest.approx(0.1 * sum(per_token) / 2)
    # Weight exp(c - sg c) keeps the score-function term for the unbiased k1 and k3: d/dc [w k] = k + dk/dc.
    #   k1: -x + 1 ; k3: (e^x - 1 - x) + (1 - e^x) = -x   (x = ref - curr)
    # k2 is biased: its own gradient dk2/dc = -x is the reverse KL's (the weight is detached); with the score-function
    # term it would be x^2/2 - x, the gradient of E[k2] (test_k2_gradient_is_the_reverse_kl_gradient_in_expectation).
    x = [LOG(2), -LOG(2)]
    d = {"k1": [-v + 1 for v in x], "k2": [-v for v in x], "k3": [-v for v in x]}[kl_type]
    torch.testing.assert_close(grad, _grad([[0.1 * v / 2 for v in d]]))


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_each_kl_estimators_gradient_is_the_reverse_kl_gradient_in_expectation(kl_type: str) -> None:
    """Exact expectation over a 6-token vocabulary, on-policy: sum_x pi(x) * (the loss's gradient when x is sampled)
    equals grad KL(pi || pi_ref) for every estimator (k2 was off by E[k2 grad log pi] with the score-function term)."""
    torch.manual_seed(0)
    logits = torch.randn(6, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(6, dtype=torch.float64).log_softmax(-1)
    log_pi = logits.log_softmax(-1)
    (exact,) = torch.autograd.grad((log_pi.exp() * (log_pi - ref)).sum(), logits)
    fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=1.0, reference_policy_kl_type=kl_type))
    expected = torch.zeros(6, dtype=torch.float64)
    for token in range(6):  # a one-token response (position 0 is the masked prompt), advantage 0: only the KL term
        lp = logits.log_softmax(-1)[token]
        curr = torch.stack([lp.new_zeros(()), lp]).reshape(1, 2)
        row = lambda value: torch.tensor([[0.0, float(value)]], dtype=torch.float64)  # noqa: E731
        data = {
            "advantages": row(0.0),
            "token_mask": row(1.0),
            "sample_mask": torch.ones(1, dtype=torch.float64),
            "generation_logprobs": row(lp),
            "reference_policy_logprobs": row(ref[token]),
        }
        loss, _ = fn(curr, data, 1.0, 1.0)
        (grad,) = torch.autograd.grad(loss, logits)
        expected += log_pi[token].exp().detach() * grad
    torch.testing.assert_close(expected, exact, atol=1e-12, rtol=1e-9)


def test_on_policy_kl_approximation_weights_by_curr_over_gen() -> None:
    # gen = curr - log 1.5 -> weight 1.5 on both tokens: mean k3 = 1.5 * 0.25 = 0.375
    gen = [[c - LOG(1.5) for c in KL_CURR[0]]]
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.1, use_on_policy_kl_approximation=True)
    loss, m, grad = _run(cfg, *_kl_batch(gen))
    assert m["kl_penalty"] == pytest.approx(0.375)
    assert float(loss) == pytest.approx(0.0375)
    # d/dc [w k3] = w (k3 + dk3/dc) = 1.5 * (-x)
    torch.testing.assert_close(grad, _grad([[0.1 * 1.5 * -LOG(2) / 2, 0.1 * 1.5 * LOG(2) / 2]]))
    # a generation logprob of -inf (past exp's range): that token's weight is 0, its gradient 0, the others' finite
    # (the weight had been zeroed after exp, whose infinite derivative made the whole gradient NaN)
    for extreme in (-math.inf,):
        loss, m, grad = _run(cfg, *_kl_batch([[extreme, KL_CURR[0][1] - LOG(1.5)]]))
        assert m["kl_penalty"] == pytest.approx(1.5 * (0.5 - 1 + LOG(2)) / 2)  # the other token's weighted k3, over both
        torch.testing.assert_close(grad, _grad([[0.0, 0.1 * 1.5 * LOG(2) / 2]]))


def test_kl_input_and_output_clamps_zero_the_gradient() -> None:
    # x = ref - curr = [log 2, -log 2, log 1.25]; input clamp 0.5 clamps the first two:
    #   k3 = [e^.5 - 1.5, e^-.5 - .5, 1.25 - 1 - log 1.25] = [0.148721, 0.106531, 0.026856]
    #   clamped tokens get no gradient (k3 is flat and the weight is detached); the third gets -x/3.
    x3 = LOG(1.25)
    curr, data = _batch([[LOG(0.25), LOG(0.5), LOG(0.4)]], [[0.0] * 3], ref=[[LOG(0.5), LOG(0.25), LOG(0.5)]])
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=1.0, kl_input_clamp_value=0.5)
    _, m, grad = _run(cfg, curr, data)
    k3 = [math.exp(0.5) - 1.5, math.exp(-0.5) - 0.5, 0.25 - x3]
    assert m["kl_penalty"] == pytest.approx(sum(k3) / 3)
    torch.testing.assert_close(grad, _grad([[0.0, 0.0, -x3 / 3]]))
    assert m["kl_clamped_fraction"] == pytest.approx(2 / 3)  # the clamps bias the estimate: counted
    # output clamp 0.2 on the unclamped-input k3 = [0.306853 -> 0.2, 0.193147, 0.026856]:
    # the clamped token has no gradient, the others have -x/3.
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=1.0, kl_output_clamp_value=0.2)
    _, m, grad = _run(cfg, curr, data)
    assert m["kl_penalty"] == pytest.approx((0.2 + LOG(2) - 0.5 + 0.25 - x3) / 3)
    torch.testing.assert_close(grad, _grad([[0.0, LOG(2) / 3, -x3 / 3]]))
    assert m["kl_clamped_fraction"] == pytest.approx(1 / 3)
    no_clamps = ClippedPGLossConfig(reference_policy_kl_penalty=1.0, kl_input_clamp_value=None, kl_output_clamp_value=None)
    assert _run(no_clamps, curr, data)[1]["kl_clamped_fraction"] == 0.0
    # No input clamp, x = 750 past exp's range (709 in these float64 tensors, 88 in float32): k3 is inf, the output
    # clamp takes it to 10, and the token gets no KL gradient (it was 0 x inf = NaN, a non-finite gradient norm that
    # skipped the whole step)
    curr, data = _batch([[-750.0, LOG(0.4)]], [[0.0] * 2], ref=[[0.0, LOG(0.5)]])
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=1.0, kl_input_clamp_value=None, kl_output_clamp_value=10.0)
    _, m, grad = _run(cfg, curr, data)
    assert m["kl_penalty"] == pytest.approx((10.0 + 0.25 - x3) / 2)
    torch.testing.assert_close(grad, _grad([[0.0, -x3 / 2]]))


def test_missing_reference_logprobs_is_a_clear_error() -> None:
    curr, data = _batch([[LOG(0.5)]], [[1.0]])
    fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.1))
    with pytest.raises(ValueError, match="reference_policy_logprobs"):
        fn(curr, data, 1, 1)


# ---------------------------------------------------------------- trust region (seed 004)

# gen prob 0.5 everywhere, on-policy (no prev). prob diffs and advantages:
#   t1 0.8 (+0.3) A=+1    -> dropped (moved up past +0.2 in the direction A pushes)
#   t2 0.6 (+0.1) A=+2    -> kept
#   t3 0.2 (-0.3) A=-1    -> dropped
#   t4 0.4 (-0.1) A=-3    -> kept
#   t5 0.8 (+0.3) A=-0.5  -> kept (moved against its advantage)
#   t6 0.2 (-0.3) A=+0.25 -> kept
TR_PROBS = [0.8, 0.6, 0.2, 0.4, 0.8, 0.2]
TR_ADV = [[1.0, 2.0, -1.0, -3.0, -0.5, 0.25]]
TR_KEPT = [False, True, False, True, True, True]


def _tr_batch():
    return _batch([[LOG(p) for p in TR_PROBS]], TR_ADV, gen=[[LOG(0.5)] * 6])


@pytest.mark.parametrize("kl_tau", [0.0, 0.1])
def test_dppo_binary_tv_drops_tokens_and_kl_tau_only_on_kept(kl_tau: float) -> None:
    cfg = ClippedPGLossConfig(trust_region_type="dppo_binary_tv", kl_tau=kl_tau)
    loss, m, grad = _run(cfg, *_tr_batch())
    log_ratios = [LOG(p / 0.5) for p in TR_PROBS]
    kept_sq = [lr**2 for lr, k in zip(log_ratios, TR_KEPT) if k]
    # kept: -A r with r = 1: -2 + 3 + 0.5 - 0.25 = 1.25 ; plus kl_tau * sum kept (c - g)^2, / 6
    assert float(loss) == pytest.approx((1.25 + kl_tau * sum(kept_sq)) / 6)
    expected_grad = [(-a + 2 * kl_tau * lr) / 6 if k else 0.0 for a, lr, k in zip(TR_ADV[0], log_ratios, TR_KEPT)]
    torch.testing.assert_close(grad, _grad([expected_grad]))
    assert float(grad[0, 0]) == 0.0 and float(grad[0, 2]) == 0.0  # exactly zero
    assert m["trust_region/masked_fraction"] == pytest.approx(2 / 6)
    assert m["trust_region/kl_penalty"] == pytest.approx(sum(kept_sq) / 4)  # mean over kept


def test_trust_region_uses_the_unclipped_ratio() -> None:
    # kept token (prob 0.6 vs gen 0.6) with r = curr/prev = 1.5, A = 1 -> -1.5 (PPO would clip to -1.2)
    curr, data = _batch([[LOG(0.6)]], [[1.0]], prev=[[LOG(0.4)]], gen=[[LOG(0.6)]])
    loss, m, grad = _run(ClippedPGLossConfig(trust_region_type="dppo_binary_tv"), curr, data)
    assert float(loss) == pytest.approx(-1.5)
    torch.testing.assert_close(grad, _grad([[-1.5]]))
    assert m["clip_fraction"] == 0.0


# ---------------------------------------------------------------- masking and robustness

CONFIGS = {
    "ppo_default": {},
    "ppo_dual_clip_tis": {
        "ratio_clip_c": 3.0,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
    },
    "icepop_k3_on_policy_kl": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 2.0,
        "truncated_importance_sampling_ratio_min": 0.5,
        "reference_policy_kl_penalty": 0.05,
        "use_on_policy_kl_approximation": True,
    },
    "gspo_icepop": {  # (seq-mask-tis beside GSPO is refused: its mask does not bound the sequence product)
        "sequence_level_importance_ratios": True,
        "token_level_loss": False,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 2.0,
        "truncated_importance_sampling_ratio_min": 0.5,
    },
    "sequence_level_k1": {"token_level_loss": False, "reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k1"},
    "cispo": {"use_cispo": True, "use_importance_sampling_correction": True},
    "reinforce": {"disable_ppo_ratio": True},
    "force_on_policy_k2": {"force_on_policy_ratio": True, "reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k2"},
    "dppo_kl_tau": {"trust_region_type": "dppo_binary_tv", "kl_tau": 0.1, "use_importance_sampling_correction": True},
}


def _random_batch(seed: int, batch: int = 8, seq: int = 12) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    gen = torch.log(rand(batch, seq) * 0.98 + 0.01)
    prev = (gen + 0.3 * randn(batch, seq)).clamp(max=-1e-3)
    curr = (prev + 0.3 * randn(batch, seq)).clamp(max=-1e-3)
    lengths = torch.randint(3, seq + 1, (batch,), generator=g)
    token_mask = (torch.arange(seq)[None, :] < lengths[:, None]).double()
    token_mask[:, :2] = 0  # a two-token prompt
    sample_mask = torch.ones(batch, dtype=torch.float64)
    sample_mask[5] = 0
    advantages = randn(batch, 1).expand(batch, seq).clone()
    data = {
        "generation_logprobs": gen,
        "prev_logprobs": prev,
        "advantages": advantages,
        "reference_policy_logprobs": (prev + 0.2 * randn(batch, seq)).clamp(max=-1e-3),
        "token_mask": token_mask,
        "sample_mask": sample_mask,
    }
    return curr.requires_grad_(True), data


@pytest.mark.parametrize("name", list(CONFIGS))
def test_masked_positions_get_exactly_zero_gradient_even_with_garbage(name: str) -> None:
    curr, data = _random_batch(seed=1)
    invalid = (data["token_mask"] * data["sample_mask"][:, None]) == 0
    with torch.no_grad():
        curr[invalid] = -math.inf  # e.g. a padding logprob of -inf
    for key in ("generation_logprobs", "prev_logprobs", "reference_policy_logprobs"):
        data[key] = data[key].masked_fill(invalid, math.nan)
    fn = ClippedPGLossFn(ClippedPGLossConfig(**CONFIGS[name]))
    loss, metrics = fn(curr, data, data["sample_mask"].sum(), (~invalid).sum())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(math.isfinite(v) for v in metrics.values())
    assert bool((curr.grad[invalid] == 0).all())
    assert bool((curr.grad[~invalid] != 0).any())


# ---------------------------------------------------------------- microbatch contract


@pytest.mark.parametrize("name", list(CONFIGS))
def test_microbatches_sum_to_the_full_batch(name: str) -> None:
    """Split 8 samples 3/3/2: losses sum, gradients and every combined metric match."""
    fn = ClippedPGLossFn(ClippedPGLossConfig(**CONFIGS[name]))
    curr, data = _random_batch(seed=2)
    n_seq = data["sample_mask"].sum()
    n_tok = (data["token_mask"] * data["sample_mask"][:, None]).sum()

    full_loss, full_fragments = fn(curr, data, n_seq, n_tok)
    (full_grad,) = torch.autograd.grad(full_loss, curr)
    full = combine_metric_fragments([full_fragments], fn.metric_reduction)

    losses, fragments = [], []
    for rows in (slice(0, 3), slice(3, 6), slice(6, 8)):
        mb_data = {k: v[rows] for k, v in data.items()}
        mb_loss, mb_metrics = fn(curr[rows], mb_data, n_seq, n_tok)
        losses.append(mb_loss)
        fragments.append(mb_metrics)
    (mb_grad,) = torch.autograd.grad(sum(losses), curr)
    combined = combine_metric_fragments(fragments, fn.metric_reduction)
    # Two "data-parallel ranks" combined separately first, then together.
    nested = combine_metric_fragments(
        [combine_metric_fragments(fragments[:2], fn.metric_reduction), combine_metric_fragments(fragments[2:], fn.metric_reduction)],
        fn.metric_reduction,
    )

    assert float(sum(losses).detach()) == pytest.approx(float(full_loss.detach()), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(mb_grad, full_grad, rtol=1e-10, atol=1e-12)
    assert set(combined) == set(full) and "rollout_corr/is_eff_sample_size" in full
    for key, value in full.items():
        assert combined[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
        assert nested[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_metric_values_are_python_floats_and_loss_equals_metric() -> None:
    curr, data = _random_batch(seed=3)
    fn = ClippedPGLossFn(ClippedPGLossConfig())
    loss, metrics = fn(curr, data, 7, 40)
    assert all(type(v) is float for v in metrics.values())
    assert metrics["loss"] == pytest.approx(float(loss.detach()))
    assert fn.metric_reduction("probs_ratio_min") == "min"
    assert fn.metric_reduction("probs_ratio_clamped_max") == "max"
    assert fn.metric_reduction("gen_kl") == "sum"


def test_a_logprob_or_advantage_tensor_of_another_shape_is_refused_by_name() -> None:
    """A per-sample [B] advantage broadcast along the sequence where B == S (a loss of -2.5 for -2.0), and other
    mismatches were bare torch broadcast errors naming no key."""
    curr, data = _batch([[-1.0, -2.0], [-0.5, -1.5], [-1.0, -1.0]], [[1.0, 1.0], [2.0, 2.0], [-1.0, -1.0]])
    fn = ClippedPGLossFn(ClippedPGLossConfig())
    for key, bad in (("advantages", torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)), ("prev_logprobs", curr.detach()[:, :2])):
        with pytest.raises(ValueError, match=rf"data\['{key}'\] has shape .*, expected \(3, 3\)"):
            fn(curr, {**data, key: bad}, 3, 6)


def test_constructor_accepts_a_plain_mapping() -> None:
    fn = ClippedPGLossFn({"ratio_clip_max": 0.28})
    assert fn.cfg.ratio_clip_max == 0.28 and fn.surrogate_name == "ppo_clip"


def test_truncations_and_the_dppo_band_honour_each_bound_on_its_own_side():
    """Asymmetric bounds, values on and past each bound: a lower bound read as the upper one (or a strict comparison
    turned loose) moves a flag or a weight here."""
    from nemo_like.algorithms.loss_functions import (
        LossInputs,
        dppo_binary_tv_keep_mask,
        icepop_truncation,
        seq_mask_tis_truncation,
        tis_truncation,
    )

    log = lambda *xs: torch.tensor([math.log(x) for x in xs], dtype=torch.float64)  # noqa: E731
    log_w = log(0.25, 0.5, 1.0, 2.0, 4.0)  # low 0.5 and high 2.0 are hit exactly
    weights, out = tis_truncation(log_w, log_w, 0.5, 2.0)
    assert torch.allclose(weights, torch.tensor([0.5, 0.5, 1.0, 2.0, 2.0], dtype=torch.float64))
    assert out.tolist() == [True, False, False, False, True]
    weights, out = icepop_truncation(log_w, log_w, 0.5, 2.0)
    assert torch.allclose(weights, torch.tensor([0.0, 0.5, 1.0, 2.0, 0.0], dtype=torch.float64))
    assert out.tolist() == [True, False, False, False, True]
    weights, out = tis_truncation(log_w, log_w, None, 2.0)  # no lower bound: 0
    assert out.tolist() == [False, False, False, False, True] and weights[0].item() == pytest.approx(0.25)
    token_log_w = torch.zeros(5, 2, dtype=torch.float64)
    weights, out = seq_mask_tis_truncation(token_log_w, log_w, 0.5, 2.0)  # per sequence: its geometric mean decides
    assert out.tolist() == [True, False, False, False, True]
    assert weights.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]

    # DPPO, band [-low, +high] = [-0.1, +0.3] on pi_curr - pi_gen of the sampled token (pi_gen = 0.5 everywhere)
    moves = torch.tensor([[0.2, 0.35, -0.05, -0.2, 0.2, 0.35, -0.05, -0.2]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    gen = torch.full_like(moves, math.log(0.5))
    ones = torch.ones_like(moves)
    inputs = LossInputs(
        curr=torch.log(0.5 + moves), prev=gen, gen=gen, ref=None, advantages=advantages, mask=ones, valid=ones.bool(),
        sample_mask=torch.ones(1), global_valid_toks=torch.tensor(8.0), global_valid_seqs=torch.tensor(1.0),
    )  # fmt: skip
    kept = dppo_binary_tv_keep_mask(inputs, 0.1, 0.3)
    # A > 0 drops a rise past +0.3 only; A < 0 drops a fall past -0.1 only (moves against the advantage are kept)
    assert kept.tolist() == [[True, False, True, True, True, True, True, False]]
