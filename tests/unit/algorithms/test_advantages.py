"""Baselines, std, normalisation, the estimator registry and the advantage/reward metrics."""

from __future__ import annotations

import math
import re

import pytest
import torch

from nemo_like.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageResult,
    advantage_metrics,
    compute_advantages,
    register_advantage_estimator,
    reward_group_metrics,
)
from nemo_like.algorithms.utils import calculate_baseline_and_std_per_prompt, normalize_advantages_with_epsilon

T = torch.tensor
SQRT_THIRD = math.sqrt(1 / 3)


def ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bool)


def assert_close(actual: torch.Tensor, expected: list[float], atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.double(), T(expected, dtype=torch.float64), atol=atol, rtol=0)


# Two prompts, interleaved: prompt 0 -> rewards [1, 2, 3] (rows 0, 2, 4), prompt 1 -> [0, 0, 1, 1].
TWO_PROMPT_IDS = T([0, 1, 0, 1, 0, 1, 1])
TWO_PROMPT_REWARDS = T([1.0, 0.0, 2.0, 0.0, 3.0, 1.0, 1.0])


def test_leave_one_out_two_prompts():
    baseline, std = calculate_baseline_and_std_per_prompt(TWO_PROMPT_IDS, TWO_PROMPT_REWARDS, ones(7), True)
    # prompt 0: r=1 -> others [2,3]: mean 2.5, std sqrt((.25+.25)/1)=sqrt(.5); r=2 -> [1,3]: 2, sqrt(2);
    #           r=3 -> [1,2]: 1.5, sqrt(.5).
    # prompt 1: r=0 -> others [0,1,1]: mean 2/3, var ((4+1+1)/9)/2 = 1/3; r=1 -> [0,0,1]: 1/3, var 1/3.
    assert_close(baseline, [2.5, 2 / 3, 2.0, 2 / 3, 1.5, 1 / 3, 1 / 3])
    assert_close(std, [math.sqrt(0.5), SQRT_THIRD, math.sqrt(2), SQRT_THIRD, math.sqrt(0.5), SQRT_THIRD, SQRT_THIRD])


def test_group_mean_and_bessel_std_without_leave_one_out():
    baseline, std = calculate_baseline_and_std_per_prompt(TWO_PROMPT_IDS, TWO_PROMPT_REWARDS, ones(7), False)
    # prompt 0: mean 2, std sqrt((1+0+1)/2) = 1; prompt 1: mean .5, std sqrt(4*.25/3) = sqrt(1/3).
    assert_close(baseline, [2.0, 0.5, 2.0, 0.5, 2.0, 0.5, 0.5])
    assert_close(std, [1.0, SQRT_THIRD, 1.0, SQRT_THIRD, 1.0, SQRT_THIRD, SQRT_THIRD])


@pytest.mark.parametrize("loo", [False, True])
def test_single_generation_per_prompt(loo: bool):
    rewards = T([0.3, 1.0, 0.0])
    baseline, std = calculate_baseline_and_std_per_prompt(T([4, 5, 6]), rewards, ones(3), loo)
    # One valid sample: baseline = its reward, std 0 -> advantage 0.
    assert_close(baseline, [0.3, 1.0, 0.0])
    assert_close(std, [0.0, 0.0, 0.0])
    result = compute_advantages(
        "grpo",
        rewards=rewards,
        prompt_ids=T([4, 5, 6]),
        valid_mask=ones(3),
        normalize_rewards=True,
        use_leave_one_out_baseline=loo,
    )
    assert torch.equal(result.advantages, torch.zeros(3))


def test_leave_one_out_with_two_samples_has_zero_std():
    baseline, std = calculate_baseline_and_std_per_prompt(T([0, 0]), T([1.0, 0.0]), ones(2), True)
    # The baseline is the single other reward; the std of one sample is 0.
    assert_close(baseline, [0.0, 1.0])
    assert torch.equal(std, torch.zeros(2))


@pytest.mark.parametrize("loo", [False, True])
def test_identical_rewards_give_exactly_zero_std_and_advantage(loo: bool):
    # 0.7 is not representable in binary: a moment-based variance would leave a ~1e-17 residue.
    # (E[r^2] - E[r]^2 over seven 0.7s is -2.2e-16 in float64.)
    rewards = torch.full((7,), 0.7, dtype=torch.float64)
    result = compute_advantages(
        "grpo",
        rewards=rewards,
        prompt_ids=torch.zeros(7, dtype=torch.long),
        valid_mask=ones(7),
        normalize_rewards=True,
        use_leave_one_out_baseline=loo,
    )
    assert torch.equal(result.std, torch.zeros(7, dtype=torch.float64))
    assert torch.equal(result.advantages, torch.zeros(7, dtype=torch.float64))


def test_leave_one_out_advantages_are_scaled_by_the_groups_std_not_the_others():
    # Leave-one-out, rewards [1, 0, 0, 0]: sample 0's peers are all 0 -> baseline 0, advantage 1; the others: baseline
    # 1/3, advantage -1/3. All are divided by the group's Bessel std, 0.5 (mean 1/4, var 0.75 / 3): 2 and -2/3.
    result = compute_advantages(
        "grpo",
        rewards=T([1.0, 0.0, 0.0, 0.0]),
        prompt_ids=torch.zeros(4, dtype=torch.long),
        valid_mask=ones(4),
        normalize_rewards=True,
        use_leave_one_out_baseline=True,
    )
    assert_close(result.std, [0.5] * 4)
    assert_close(result.advantages, [2.0, -2 / 3, -2 / 3, -2 / 3], atol=1e-5)
    # Peers that nearly agree: their own std is tiny (1e-2 / sqrt(7)); dividing by it gave sample 0 an advantage of 264
    # (and 23,197 for [1, 0.1 x 6, 0.1001]). The group's std keeps it at the scale of the plain GRPO advantage.
    for rewards in ([1.0] + [0.0] * 6 + [0.01], [1.0] + [0.1] * 6 + [0.1001]):
        loo = compute_advantages(
            "grpo", rewards=T(rewards), prompt_ids=torch.zeros(8, dtype=torch.long), valid_mask=ones(8),
            normalize_rewards=True, use_leave_one_out_baseline=True,
        )  # fmt: skip
        plain = compute_advantages(
            "grpo", rewards=T(rewards), prompt_ids=torch.zeros(8, dtype=torch.long), valid_mask=ones(8),
            normalize_rewards=True, use_leave_one_out_baseline=False,
        )  # fmt: skip
        # r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean): the same direction, scaled by 8 / 7
        torch.testing.assert_close(loo.advantages, plain.advantages * 8 / 7, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("own, peer", [(0.7, 0.1), (0.0, 0.7), (0.0, 0.9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_std_detection_is_exact_for_non_dyadic_rewards(own: float, peer: float, dtype: torch.dtype):
    # Rewards [own, peer, peer, peer], leave-one-out reference sets: sample 0's peers are all equal -> std exactly 0,
    # baseline exactly `peer`. From group sums, [0, .7, .7, .7] leaves a variance residue of ~1e-16 (std ~1e-8).
    rewards = T([own, peer, peer, peer], dtype=dtype)
    baseline, std = calculate_baseline_and_std_per_prompt(torch.zeros(4, dtype=torch.long), rewards, ones(4), True)
    assert std[0] == 0.0 and baseline[0] == rewards[1]


def test_normalize_with_epsilon_skips_zero_std_and_broadcasts_over_tokens():
    advantages = T([[2.0, 2.0], [-1.0, -1.0], [0.5, 0.5]])
    std = T([2.0, 0.0, 0.5])
    out = normalize_advantages_with_epsilon(advantages, std, epsilon=1e-6)
    # 2 / (2 + 1e-6) ~= 1; std 0 -> unchanged (-1, not -1e6); 0.5 / 0.5 ~= 1.
    torch.testing.assert_close(out, T([[1.0, 1.0], [-1.0, -1.0], [1.0, 1.0]]), atol=1e-5, rtol=0)
    assert out[1, 0] == -1.0
    assert torch.equal(advantages, T([[2.0, 2.0], [-1.0, -1.0], [0.5, 0.5]]))  # input untouched


def test_masked_samples_do_not_enter_baselines():
    rewards = T([1.0, 0.0, 5.0, 0.0, 9.0])
    prompt_ids = T([0, 0, 0, 0, 1])
    valid = T([1, 1, 0, 1, 0])
    baseline, std = calculate_baseline_and_std_per_prompt(prompt_ids, rewards, valid, False)
    # Prompt 0 valid rewards [1, 0, 0]: mean 1/3, std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3); the
    # invalid 5 is ignored, and itself gets the valid group's values. Prompt 1 has no valid sample:
    # baseline = its own reward, std 0.
    assert_close(baseline, [1 / 3, 1 / 3, 1 / 3, 1 / 3, 9.0])
    assert_close(std, [SQRT_THIRD, SQRT_THIRD, SQRT_THIRD, SQRT_THIRD, 0.0])

    baseline, std = calculate_baseline_and_std_per_prompt(prompt_ids, rewards, valid, True)
    # Leave-one-out: r=1 -> peers [0, 0]: 0, std 0; r=0 -> peers [1, 0]: .5, std sqrt(.5);
    # the invalid sample leaves nothing out: 1/3, sqrt(1/3).
    assert_close(baseline, [0.0, 0.5, 1 / 3, 0.5, 9.0])
    assert_close(std, [0.0, math.sqrt(0.5), SQRT_THIRD, math.sqrt(0.5), 0.0])

    result = compute_advantages(
        "grpo",
        rewards=rewards,
        prompt_ids=prompt_ids,
        valid_mask=valid,
        normalize_rewards=False,
        use_leave_one_out_baseline=True,
    )
    assert_close(result.advantages, [1.0, -0.5, 0.0, -0.5, 0.0])


def test_nan_reward_raises_naming_sample_and_group():
    with pytest.raises(ValueError, match=r"index\(es\) \[1\].*group\(s\) \[7\]"):
        calculate_baseline_and_std_per_prompt(T([7, 7, 9, 9]), T([0.0, math.nan, 1.0, 0.0]), ones(4), True)
    # Also when the sample is masked: NaN * 0 is still NaN downstream.
    with pytest.raises(ValueError, match=r"index\(es\) \[2, 3\]"):
        calculate_baseline_and_std_per_prompt(T([7, 7, 9, 9]), T([0.0, 1.0, math.inf, -math.inf]), T([1, 1, 0, 0]), False)


def test_prompt_rows_are_grouped_by_token_equality():
    rows = T([[5, 6, 0], [1, 2, 3], [5, 6, 0], [1, 2, 3], [5, 6, 1]])
    rewards = T([1.0, 0.0, 0.0, 0.0, 1.0])
    baseline, std = calculate_baseline_and_std_per_prompt(rows, rewards, ones(5), False)
    # Groups {0, 2} (mean .5, std sqrt(.5)), {1, 3} (0, 0), {4} (alone: its reward, 0).
    assert_close(baseline, [0.5, 0.0, 0.5, 0.0, 1.0])
    assert_close(std, [math.sqrt(0.5), 0.0, math.sqrt(0.5), 0.0, 0.0])
    same = calculate_baseline_and_std_per_prompt(T([0, 1, 0, 1, 2]), rewards, ones(5), False)
    torch.testing.assert_close(same, (baseline, std))


def test_empty_batch():
    baseline, std = calculate_baseline_and_std_per_prompt(torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0), True)
    assert baseline.shape == std.shape == (0,)


def _slow_reference(prompt_ids, rewards, valid, loo):
    """Obvious per-sample loops, in float64."""
    n = len(rewards)
    baseline, std = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        ref = [float(rewards[j]) for j in range(n) if prompt_ids[j] == prompt_ids[i] and valid[j] and not (loo and valid[i] and j == i)]
        baseline[i] = sum(ref) / len(ref) if ref else float(rewards[i])
        # Equal values: std exactly 0 (the naive formula below can leave a ~1e-17 residue).
        if len(set(ref)) >= 2:
            mean = sum(ref) / len(ref)
            std[i] = math.sqrt(sum((x - mean) ** 2 for x in ref) / (len(ref) - 1))
    return baseline, std


@pytest.mark.parametrize("loo", [False, True])
@pytest.mark.parametrize("discrete", [False, True])
def test_vectorised_matches_slow_reference(loo: bool, discrete: bool):
    gen = torch.Generator().manual_seed(1234 + 2 * loo + discrete)
    for _ in range(5):
        n = int(torch.randint(1, 60, (1,), generator=gen))
        prompt_ids = torch.randint(0, 8, (n,), generator=gen)
        valid = torch.rand(n, generator=gen) > 0.2
        if discrete:  # many ties: exercises the exact zero-std paths
            rewards = torch.randint(0, 3, (n,), generator=gen).double() / 10
        else:
            rewards = torch.randn(n, generator=gen, dtype=torch.float64) * 3 + 1
        baseline, std = calculate_baseline_and_std_per_prompt(prompt_ids, rewards, valid, loo)
        ref_baseline, ref_std = _slow_reference(prompt_ids, rewards, valid, loo)
        torch.testing.assert_close(baseline, ref_baseline, atol=1e-10, rtol=0)
        torch.testing.assert_close(std, ref_std, atol=1e-10, rtol=0)
        assert torch.equal(std == 0, ref_std == 0)


def test_large_batch_stays_finite():
    """10k samples with [B, 64] prompt rows (speed is measured in benchmarks, never asserted here)."""
    n = 10_000
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 50, (n // 8, 64), generator=gen).repeat_interleave(8, dim=0)
    rewards = torch.randint(0, 2, (n,), generator=gen).float()
    for loo in (False, True):
        baseline, std = calculate_baseline_and_std_per_prompt(rows, rewards, ones(n), loo)
    assert torch.isfinite(baseline).all() and torch.isfinite(std).all()


def test_float32_rewards_keep_dtype():
    baseline, std = calculate_baseline_and_std_per_prompt(TWO_PROMPT_IDS, TWO_PROMPT_REWARDS, ones(7), True)
    assert baseline.dtype == std.dtype == torch.float32


# ---------------------------------------------------------------- registry and estimators


def test_registry_names_and_unknown_name():
    assert {"grpo", "rloo", "dr_grpo"} <= set(ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError, match=r"'ppo'.*\['dr_grpo', 'grpo', 'rloo'"):
        compute_advantages(
            "ppo",
            rewards=T([1.0]),
            prompt_ids=T([0]),
            valid_mask=ones(1),
            normalize_rewards=True,
            use_leave_one_out_baseline=False,
        )
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo")(lambda **kw: None)


ONE_PROMPT = dict(prompt_ids=torch.zeros(4, dtype=torch.long), valid_mask=ones(4))
REWARDS_1001 = T([1.0, 0.0, 0.0, 1.0])


def test_grpo_normalised_values():
    result = compute_advantages("grpo", rewards=REWARDS_1001, **ONE_PROMPT, normalize_rewards=True, use_leave_one_out_baseline=False)
    # mean .5, std sqrt(4 * .25 / 3) = sqrt(1/3): +-.5 / sqrt(1/3) = +-0.8660.
    assert isinstance(result, AdvantageResult)
    assert_close(result.advantages, [0.8660254, -0.8660254, -0.8660254, 0.8660254], atol=1e-5)


@pytest.mark.parametrize("loo_flag", [False, True])
def test_rloo_always_leaves_one_out(loo_flag: bool):
    result = compute_advantages("rloo", rewards=REWARDS_1001, **ONE_PROMPT, normalize_rewards=False, use_leave_one_out_baseline=loo_flag)
    # r=1 -> peers [0,0,1]: baseline 1/3, A = 2/3; r=0 -> peers [0,1,1]: 2/3, A = -2/3. Not divided.
    assert_close(result.baseline, [1 / 3, 2 / 3, 2 / 3, 1 / 3])
    assert_close(result.advantages, [2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_rloo_normalises_only_when_asked():
    result = compute_advantages("rloo", rewards=REWARDS_1001, **ONE_PROMPT, normalize_rewards=True, use_leave_one_out_baseline=False)
    # The group's std, sqrt(1/3) (here also the other samples' std): (2/3) / sqrt(1/3) = 2 / sqrt(3) = 1.1547.
    assert_close(result.advantages, [1.1547005, -1.1547005, -1.1547005, 1.1547005], atol=1e-5)
    # Where the two differ: the other samples of sample 0 are [0 x 6, 0.01], std 0.0038; divided by it, its advantage
    # was 264. Divided by the group's std, rloo's advantages are grpo's times n / (n - 1) (r_i - mean of the others
    # = n / (n - 1) * (r_i - mean)).
    rewards = torch.tensor([1.0] + [0.0] * 6 + [0.01])
    group = dict(prompt_ids=torch.zeros(8, dtype=torch.long), valid_mask=ones(8))
    rloo = compute_advantages("rloo", rewards=rewards, **group, normalize_rewards=True, use_leave_one_out_baseline=False)
    grpo = compute_advantages("grpo", rewards=rewards, **group, normalize_rewards=True, use_leave_one_out_baseline=False)
    assert_close(rloo.advantages, (grpo.advantages * 8 / 7).tolist(), atol=1e-5)
    assert float(rloo.advantages[0]) < 3.0


@pytest.mark.parametrize("normalize", [False, True])
def test_dr_grpo_never_divides_by_std(normalize: bool):
    result = compute_advantages("dr_grpo", rewards=REWARDS_1001, **ONE_PROMPT, normalize_rewards=normalize, use_leave_one_out_baseline=True)
    # Group mean .5 (leave-one-out ignored), std sqrt(1/3) reported but not used.
    assert_close(result.advantages, [0.5, -0.5, -0.5, 0.5])
    assert_close(result.std, [SQRT_THIRD] * 4)


@pytest.mark.parametrize("name", ["grpo", "rloo", "dr_grpo"])
def test_invalid_samples_get_zero_advantage(name: str):
    result = compute_advantages(
        name,
        rewards=T([1.0, 0.0, 1.0, 0.0]),
        prompt_ids=torch.zeros(4, dtype=torch.long),
        valid_mask=T([1, 1, 0, 0]),
        normalize_rewards=True,
        use_leave_one_out_baseline=True,
    )
    assert result.advantages[2] == 0 and result.advantages[3] == 0
    assert torch.isfinite(result.advantages).all()


# ---------------------------------------------------------------- metrics


def test_advantage_metrics_over_valid_tokens():
    advantages = T([[9.0, 1.0, 2.0], [9.0, -3.0, 9.0]])
    mask = T([[0, 1, 1], [0, 1, 0]])
    # Valid tokens: 1, 2, -3 -> mean 0, max 2, min -3 (the 9s are masked).
    assert advantage_metrics(advantages, mask) == {"advantages/mean": 0.0, "advantages/max": 2.0, "advantages/min": -3.0}
    # A [B] tensor is broadcast over the tokens: 1, 1, 5 -> mean 7/3.
    assert advantage_metrics(T([1.0, 5.0]), mask)["advantages/mean"] == pytest.approx(7 / 3)


def test_advantage_metrics_empty_mask_is_zero():
    metrics = advantage_metrics(torch.randn(2, 3), torch.zeros(2, 3))
    assert metrics == {"advantages/mean": 0.0, "advantages/max": 0.0, "advantages/min": 0.0}


def test_reward_group_metrics():
    # Groups: 0 -> [1, 1] (all 1), 1 -> [0, 0] (all 0), 2 -> [0, 1] + an invalid 1 (mixed),
    # 3 -> [.5, .5] (mixed, zero std), 4 -> only an invalid sample (ignored).
    prompt_ids = T([0, 0, 1, 1, 2, 2, 2, 3, 3, 4])
    rewards = T([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.3])
    valid = T([1, 1, 1, 1, 1, 1, 0, 1, 1, 0])
    metrics = reward_group_metrics(rewards, prompt_ids, valid)
    # Valid rewards [1,1,0,0,0,1,.5,.5]: mean .5, squared deviations 6 * .25 = 1.5, Bessel: sqrt(1.5/7).
    assert metrics["reward_std"] == pytest.approx(math.sqrt(1.5 / 7))
    assert metrics["frac_reward_zero_std"] == pytest.approx(3 / 4)
    assert metrics["baseline_reward/pct_0"] == pytest.approx(1 / 4)
    assert metrics["baseline_reward/pct_1"] == pytest.approx(1 / 4)
    assert metrics["baseline_reward/pct_mixed"] == pytest.approx(2 / 4)


def test_a_group_mean_outside_zero_one_is_in_none_of_the_three_shares():
    # Groups: 0 -> [2, 3] (partial rewards above 1: neither all 0, all 1 nor mixed), 1 -> [0, 1] (mixed).
    metrics = reward_group_metrics(T([2.0, 3.0, 0.0, 1.0]), T([0, 0, 1, 1]), T([1, 1, 1, 1]))
    assert metrics["baseline_reward/pct_mixed"] == pytest.approx(1 / 2)
    assert metrics["baseline_reward/pct_0"] == metrics["baseline_reward/pct_1"] == 0.0


def test_reward_group_metrics_no_valid_sample_is_zero():
    metrics = reward_group_metrics(T([1.0, 0.0]), T([0, 0]), T([0, 0]))
    assert set(metrics) == {
        "reward_std",
        "frac_reward_zero_std",
        "baseline_reward/pct_0",
        "baseline_reward/pct_1",
        "baseline_reward/pct_mixed",
    }
    assert all(v == 0.0 for v in metrics.values())


def test_every_built_in_estimator_is_a_group_baseline_that_zeroes_groups_of_one():
    """The config warns about grpo.num_generations_per_prompt=1 for GROUP_BASELINE_ESTIMATORS: each built-in estimator
    must be listed there, and must give 0 to every sample that is alone in its group."""
    from nemo_like.config.schema import GROUP_BASELINE_ESTIMATORS

    built_in = [n for n in ADVANTAGE_ESTIMATORS.names() if ADVANTAGE_ESTIMATORS.get(n).__module__.startswith("nemo_like.")]
    assert sorted(built_in) == sorted(GROUP_BASELINE_ESTIMATORS)  # other tests may register their own
    rewards, prompts = torch.tensor([1.0, 0.0, 0.7]), torch.tensor([0, 1, 2])
    for name in GROUP_BASELINE_ESTIMATORS:
        for leave_one_out in (False, True):
            result = compute_advantages(
                name,
                rewards=rewards,
                prompt_ids=prompts,
                valid_mask=ones(3),
                normalize_rewards=True,
                use_leave_one_out_baseline=leave_one_out,
            )
            assert result.advantages.tolist() == [0.0, 0.0, 0.0], (name, leave_one_out)


def test_a_user_estimators_output_is_checked_naming_the_key(tmp_path, monkeypatch):
    """A user's estimator (by import path) returning a bare tensor, advantages of another length or NaN failed deep in
    the loop (an AttributeError, a size mismatch) or, NaN, skipped every update as a "non-finite loss" that advised a
    lower learning rate."""
    from nemo_like.algorithms.advantages import AdvantageResult
    from nemo_like.config.errors import ConfigError

    (tmp_path / "my_estimators.py").write_text(
        "import torch\n"
        "from nemo_like.algorithms.advantages import AdvantageResult\n"
        "def bare(rewards, **kw):\n    return rewards - rewards.mean()\n"
        "def short(rewards, **kw):\n    z = torch.zeros(len(rewards) // 2)\n    return AdvantageResult(z, z, z)\n"
        "def nan(rewards, **kw):\n    z = torch.zeros_like(rewards)\n    return AdvantageResult(z / 0, z, z)\n"
        "def fine(rewards, **kw):\n    z = torch.zeros_like(rewards)\n    return AdvantageResult(rewards - rewards.mean(), z, z)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    args = {"rewards": rewards, "prompt_ids": torch.tensor([0, 0, 1, 1]), "valid_mask": torch.ones(4)}
    args |= {"normalize_rewards": True, "use_leave_one_out_baseline": False}
    for name, message in (
        ("bare", "returned a Tensor, not an AdvantageResult"),
        ("short", "returned advantages of shape (2,), not the rewards' (4,)"),
        ("nan", "returned 4 non-finite advantages of 4"),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"grpo.adv_estimator.name='my_estimators:{name}' {message}")):
            compute_advantages(f"my_estimators:{name}", **args)
    assert isinstance(compute_advantages("my_estimators:fine", **args), AdvantageResult)
