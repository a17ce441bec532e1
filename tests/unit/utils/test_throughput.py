"""Throughput and time-share arithmetic of one step (pure functions)."""

import pytest

from nemo_like.utils.throughput import phase_seconds, phase_shares, rate, throughput_metrics


def step_metrics(**timings: float) -> dict[str, float]:
    metrics = {f"timing/train/{phase}": seconds for phase, seconds in timings.items()}
    metrics.update(
        {
            "performance/num_batch_tokens": 1200.0,
            "performance/num_generated_tokens": 300.0,
            "performance/num_samples": 16.0,
            "train/reward": 0.5,
        }
    )
    return metrics


def test_rates_use_the_documented_numerators_and_denominators():
    metrics = step_metrics(generation=1.5, policy_training=3.0, reward=0.5, validation=1.0, total_step_time=6.0)
    out = throughput_metrics(metrics)
    # The step rates leave the validation pass out (1 s of the 6): its generation is in no count of tokens.
    assert out["performance/tokens_per_sec"] == pytest.approx(1200 / 5)
    assert out["performance/generation_tokens_per_sec"] == pytest.approx(300 / 1.5)
    assert out["performance/training_tokens_per_sec"] == pytest.approx(1200 / 3)
    assert out["performance/samples_per_sec"] == pytest.approx(16 / 5)
    assert out["timing/train/share/validation"] == pytest.approx(1 / 6)  # the shares stay of the whole step


def test_an_async_step_rates_generation_by_the_collectors_seconds():
    """The trainer of an async run does not generate (timing/train/generation is 0): the rate was always 0 there."""
    metrics = step_metrics(generation=0.0, policy_training=3.0, total_step_time=6.0)
    metrics["async/generation_seconds"] = 2.5
    assert throughput_metrics(metrics)["performance/generation_tokens_per_sec"] == pytest.approx(300 / 2.5)


def test_shares_cover_every_phase_and_sum_to_the_timed_fraction():
    metrics = step_metrics(refit=0.5, generation=1.5, policy_training=3.0, prev_logprobs=0.0, total_step_time=6.0)
    shares = phase_shares(metrics)
    assert shares == pytest.approx(
        {
            "timing/train/share/refit": 0.5 / 6,
            "timing/train/share/generation": 1.5 / 6,
            "timing/train/share/policy_training": 0.5,
            "timing/train/share/prev_logprobs": 0.0,
        }
    )
    assert sum(shares.values()) == pytest.approx(5.0 / 6)  # the untimed rest is loop overhead


def test_shares_and_totals_are_not_read_back_as_phases():
    metrics = step_metrics(generation=1.0, total_step_time=2.0)
    metrics.update(throughput_metrics(metrics))
    assert phase_seconds(metrics) == {"generation": 1.0}  # share/... and total_step_time excluded
    assert throughput_metrics(metrics)["timing/train/share/generation"] == pytest.approx(0.5)


def test_zero_time_gives_zero_rate_and_keeps_every_key():
    metrics = step_metrics(generation=0.0, policy_training=0.0, total_step_time=0.0)
    out = throughput_metrics(metrics)
    assert out == {
        "performance/tokens_per_sec": 0.0,
        "performance/generation_tokens_per_sec": 0.0,
        "performance/training_tokens_per_sec": 0.0,
        "performance/samples_per_sec": 0.0,
        "timing/train/share/generation": 0.0,
        "timing/train/share/policy_training": 0.0,
    }
    assert rate(10.0, -1.0) == 0.0


def test_missing_counts_are_zero_not_errors():
    out = throughput_metrics({"timing/train/total_step_time": 2.0, "timing/train/generation": 1.0})
    assert out["performance/tokens_per_sec"] == 0.0 and out["performance/generation_tokens_per_sec"] == 0.0
