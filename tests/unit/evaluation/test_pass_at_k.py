"""pass@k against the exact combinatorial definition, and the eval summary's arithmetic."""

from __future__ import annotations

import itertools
from math import comb

import pytest

from nemo_like.evaluation.pass_at_k import correct_counts, mean_pass_at_k, pass_at_k
from nemo_like.evaluation.run import summarize


def brute_force(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of the n samples (first c correct) that contain a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_enumeration_of_all_k_subsets(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12)


def test_matches_the_binomial_form_where_the_binomials_are_huge() -> None:
    for n, c, k in [(200, 3, 50), (500, 1, 100), (1000, 999, 10), (300, 0, 7)]:
        exact = 1 - comb(n - c, k) / comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12, abs=1e-15)


def test_one_correct_of_four() -> None:
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0  # a bootstrapped best-of-4 would say 1 - 0.75**4 = 0.68


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_mean_over_prompts_and_counts_by_group() -> None:
    counts = correct_counts([True, False, False, False, True, True, False, True], [0, 0, 0, 0, 1, 1, 1, 1])
    assert counts == [(4, 1), (4, 3)]
    result = mean_pass_at_k(counts, [1, 2])
    assert result[1] == pytest.approx((0.25 + 0.75) / 2)
    assert result[2] == pytest.approx((0.5 + 1.0) / 2)


def test_summary_accuracy_is_over_samples_and_rewards_below_one_are_not_correct() -> None:
    rows = [{"prompt_index": 0, "task": "math", "reward": r, "correct": r >= 1.0} for r in (1.0, 0.1, 0.1, 0.0)] + [
        {"prompt_index": 1, "task": "arithmetic", "reward": r, "correct": r >= 1.0} for r in (0.0, 0.0, 0.0, 0.0)
    ]
    summary = summarize(rows, [1, 4])
    assert summary["accuracy"] == pytest.approx(1 / 8)
    assert summary["mean_reward"] == pytest.approx(1.2 / 8)
    assert summary["pass@4"] == pytest.approx(0.5)
    assert summary["accuracy_per_task"] == {"math": 0.25, "arithmetic": 0.0}


def test_a_multi_turn_row_carries_its_episodes_step_metrics() -> None:
    """A row of an episode the chat template rewrote (a whitespace rewrite, a foreign end token: the episode branched)
    looked like a short answer in results.jsonl: the row carries its step counters (what training logs as multi_turn/*)."""
    import torch

    from nemo_like.data.prompts import PromptRecord
    from nemo_like.evaluation.run import result_rows
    from nemo_like.experience.rollouts import Rollout
    from nemo_like.models.generation.interface import GeneratedSample

    turns = [{"role": "assistant", "content": "7\n"}]
    cut = GeneratedSample([1], [2, 3], [-0.1, -0.2], False, 0, messages=turns, step_metrics={"template_whitespace_rewrite": 1.0})
    single = GeneratedSample([1], [2], [-0.1], False, 0)
    prompt = PromptRecord(id="p", messages=[], prompt_token_ids=[1], metadata={"answer": 7, "task_name": "arithmetic"})
    rollout = Rollout([prompt, prompt], torch.tensor([0, 0]), [cut, single], ["7\n", "7"], torch.tensor([0.0, 1.0]))
    rows = result_rows(rollout, {"arithmetic": None}, 2)
    assert rows[0]["num_turns"] == 1 and rows[0]["turns"] == turns
    assert rows[0]["step_metrics"] == {"template_whitespace_rewrite": 1.0}
    assert "step_metrics" not in rows[1] and "turns" not in rows[1]  # single-turn rows stay as they were
