"""Per-source reward means derived after the counters are summed over actors and batches."""

from nemo_like.experience.rollouts import add_counters, env_metrics_with_means


def test_the_mean_is_taken_over_samples_not_over_actors() -> None:
    # Two actors scored 3 and 1 samples of source "rm": rewards [1, 1, 1] and [0]; the per-sample mean is 0.75, the
    # mean of the actors' means would be 0.5.
    total: dict[str, float] = {}
    add_counters(total, {"env/t/rm/reward_sum": 3.0, "env/t/rm/num_samples": 3.0, "env/t/rm/truncated": 1.0})
    add_counters(total, {"env/t/rm/reward_sum": 0.0, "env/t/rm/num_samples": 1.0})
    metrics = env_metrics_with_means(total)
    assert metrics["env/t/rm/reward"] == 0.75
    assert metrics["env/t/rm/truncated"] == 1.0 and metrics["env/t/rm/num_samples"] == 4.0


def test_counters_without_a_sample_count_are_left_alone() -> None:
    counters = {"env/t/rm/reward_sum": 2.0, "env/t/calls": 5.0}
    assert env_metrics_with_means(counters) == counters
    assert env_metrics_with_means({"env/t/x/reward_sum": 0.0, "env/t/x/num_samples": 0.0}) == {
        "env/t/x/reward_sum": 0.0,
        "env/t/x/num_samples": 0.0,
    }
