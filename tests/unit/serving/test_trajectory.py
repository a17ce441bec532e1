"""Session calls -> training rows: one row when every call extends the last, branches when history is rewritten,
every sampled token masked in exactly once, inconsistent records rejected."""

from __future__ import annotations

import math

import pytest

from nemo_like.data.collate import collate_samples
from nemo_like.serving.trajectory import CallRecord, build_rows, record_problems, rows_for_training, session_rows, unsampled_positions


def call(prompt: list[int], completion: list[int], index: int, version: int = 0, choice: int = 0) -> CallRecord:
    logprobs = tuple(-0.1 * (k + 1) - index for k in range(len(completion)))
    return CallRecord(tuple(prompt), tuple(completion), logprobs, version, version, call_index=index, choice_index=choice)


def test_extending_calls_make_one_row_with_exactly_the_sampled_ids_masked_in():
    first = call([1, 2, 3], [10, 11, 2], 0, version=4)
    second = call([1, 2, 3, 10, 11, 2, 7, 8], [12, 2], 1, version=5)  # observation 7, 8 between
    result = session_rows("s", [first, second], reward=1.5)
    assert result.rejected is None and not result.branched
    (row,) = result.rows
    assert row.prompt_ids == [1, 2, 3]
    assert row.response_ids == [10, 11, 2, 7, 8, 12, 2]
    assert row.response_mask == [1, 1, 1, 0, 0, 1, 1]
    assert row.response_logprobs == [*first.logprobs, 0.0, 0.0, *second.logprobs]
    assert (row.reward, row.weight_version, row.final_weight_version, row.weight_versions) == (1.5, 4, 5, [4, 5])
    batch = collate_samples([row.to_generated_sample()], pad_token_id=0)  # the trainer's [B, S] layout
    assert batch["input_ids"][0].tolist() == [1, 2, 3, 10, 11, 2, 7, 8, 12, 2]
    assert batch["token_mask"][0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert batch["generation_logprobs"][0, 3:6].tolist() == pytest.approx(list(first.logprobs))


def test_a_rewritten_history_branches_and_never_masks_a_token_twice():
    first = call([1, 2], [10, 2], 0)
    second = call([1, 2, 10, 2, 5], [11, 2], 1)  # extends the first
    third = call([1, 9, 10, 2, 5, 11, 2, 6], [12, 2], 2)  # the template rewrote token 2 -> 9: a new row
    result = session_rows("s", [first, second, third], reward=0.5)
    assert result.rejected is None and result.branched
    assert [r.calls for r in result.rows] == [[(0, 0), (1, 0)], [(2, 0)]]
    second_row = result.rows[1]
    assert second_row.prompt_ids == list(third.prompt_ids) and second_row.response_mask == [1, 1]
    assert all(r.reward == 0.5 for r in result.rows)
    assert sum(sum(r.response_mask) for r in result.rows) == 6  # each of the 6 sampled tokens once


def test_a_call_joins_the_longest_row_it_extends_and_choices_of_n_become_siblings():
    a = call([1], [10, 2], 0, choice=0)
    b = call([1], [11, 2], 0, choice=1)  # second choice of the same call
    c = call([1, 11, 2, 4], [12, 2], 1)  # the agent continued with choice 1
    rows = build_rows("s", [a, b, c], 0.0)
    assert [r.calls for r in rows] == [[(0, 0)], [(0, 1), (1, 0)]]


def test_the_naive_concatenated_row_trains_on_tokens_nobody_sampled():
    first = call([1, 2], [10, 2], 0)
    second = call([1, 9, 10, 2, 5], [11, 2], 1)  # history rewritten (2 -> 9)
    naive_ids = list(second.prompt_ids) + list(second.completion_ids)
    naive_mask = [0, 0, 1, 1, 0, 1, 1]  # every assistant token of the final rendering
    assert unsampled_positions(naive_ids, naive_mask, [first, second]) == [2, 3]
    for row in session_rows("s", [first, second], 0.0).rows:
        assert unsampled_positions(row.input_ids, [0] * len(row.prompt_ids) + row.response_mask, [first, second]) == []


@pytest.mark.parametrize(
    "bad, problem",
    [
        (CallRecord((1,), (10, 2), (-0.1,), 0, 0), "2 sampled ids but 1 logprobs"),
        (CallRecord((1,), (10,), (math.nan,), 0, 0), "not finite"),
        (CallRecord((1,), (10,), (0.5,), 0, 0), "above 0"),
        (CallRecord((1,), (400,), (-0.1,), 0, 0), "outside the vocabulary"),
        (CallRecord((1,), (), (), 0, 0), "no sampled ids"),
    ],
)
def test_inconsistent_records_reject_the_session(bad, problem):
    assert any(problem in p for p in record_problems([bad], vocab_size=315))
    result = session_rows("s", [call([1], [10], 0), bad], 1.0, vocab_size=315)
    assert result.rows == [] and problem in result.rejected


def test_a_session_without_calls_is_rejected():
    assert session_rows("s", [], 1.0).rejected == "the session recorded no calls"


def test_rows_for_training_keep_each_rows_session():
    branched = session_rows("b", [call([1, 2], [10, 2], 0), call([1, 9, 10, 2, 5], [11, 2], 1)], reward=0.5)
    single = session_rows("s", [call([3], [12, 2], 0)], reward=1.0)
    rejected = session_rows("r", [], reward=1.0)
    batch = rows_for_training([branched, rejected, single])
    assert batch.session_of_row == [0, 0, 2] and batch.rewards == [0.5, 0.5, 1.0]
    assert [s.response_mask for s in batch.samples] == [[1, 1], [1, 1], [1, 1]]
    assert batch.samples[1].prompt_ids == [1, 9, 10, 2, 5]


def test_rows_for_training_count_every_row_of_a_session_from_its_first_call():
    """The guide's staleness rule, as a training run's agent rollouts apply it: a branched session's later row,
    whose own first call came at a later version, still carries the session's first call's version."""
    calls = [call([1, 2], [10, 2], 0, version=3), call([1, 2, 10, 2, 5], [11, 2], 1, version=3), call([1, 9], [12, 2], 2, version=4)]
    branched = session_rows("b", calls, reward=0.5)
    assert [row.weight_version for row in branched.rows] == [3, 4] and branched.weight_version == 3
    batch = rows_for_training([branched])
    assert [s.weight_version for s in batch.samples] == [3, 3] and [s.final_weight_version for s in batch.samples] == [3, 4]
    assert [s.num_turns for s in batch.samples] == [2, 1]
    assert session_rows("r", [], reward=1.0).weight_version is None


def test_decoded_tokens_past_a_cut_count_in_the_rows_and_in_a_rejected_sessions_placeholder():
    """``performance/num_generated_tokens`` counts what the engine decoded: a call the server cut at a stop string
    decoded more than its row keeps, and a rejected session's calls were decoded though no row trains them."""
    from nemo_like.data.prompts import PromptRecord
    from nemo_like.experience.agent_rollouts import placeholder_row

    cut = CallRecord((1, 2), (10, 2), (-0.1, -0.2), 0, 0, call_index=0, decoded_tokens=9)
    plain = call([1, 2, 10, 2, 5], [11, 2], 1)
    result = session_rows("s", [cut, plain], reward=1.0)
    (sample,) = rows_for_training([result]).samples
    assert sample.num_sampled_tokens == 4 and sample.num_decoded_tokens == 9 + 2 == result.decoded_tokens
    assert rows_for_training([session_rows("p", [plain], 1.0)]).samples[0].decoded_tokens is None  # nothing cut
    bad = CallRecord((1, 2), (10, 2), (-0.1, 0.5), 0, 0, decoded_tokens=7)  # a positive logprob: rejected
    rejected = session_rows("r", [bad], reward=1.0)
    assert rejected.rows == [] and rejected.decoded_tokens == 7
    assert placeholder_row(PromptRecord("p", [], [5, 6]), 0, 0, rejected.decoded_tokens).num_decoded_tokens == 7
