"""An eval in chunks: whole prompts per chunk, each chunk's seed the one a single call gave its first request, rows
appended as chunks finish and kept by an eval that stops, counters and multi-turn episodes gathered over chunks."""

import json
from types import SimpleNamespace

import pytest
import torch

from nemo_like.evaluation.chunks import PARTIAL_RESULTS, EvalChunks, prompt_chunks, seed_of_chunk
from nemo_like.experience.multi_turn import episode_metrics, multi_turn_metrics
from nemo_like.models.generation.interface import GeneratedSample, prompt_seeds


def test_chunks_hold_whole_prompts_and_seed_as_one_call_did():
    assert prompt_chunks(8, 4, 12) == [(0, 3), (3, 6), (6, 8)]
    assert prompt_chunks(3, 16, 4) == [(0, 1), (1, 2), (2, 3)]  # a prompt's samples are never split
    assert prompt_chunks(5, 1, 4096) == [(0, 5)]
    # request i of one call over every sample was seeded prompt_seeds(seed)[i]; a chunk's first request gets the same
    one_call = prompt_seeds(1234, 8 * 4)
    for first, end in prompt_chunks(8, 4, 12):
        assert prompt_seeds(seed_of_chunk(1234, first, 4), (end - first) * 4) == one_call[first * 4 : end * 4]
    assert seed_of_chunk(1234, 0, 4) == 1234  # an eval of one chunk samples as before


def rollout(rewards, sessions=None, metrics=None):
    samples = [GeneratedSample([1], [2, 3], [-0.1, -0.1], False, 0, num_turns=2, step_metrics={"calls": 1.0}) for _ in rewards]
    owners = None if sessions is None else torch.tensor(sessions)
    return SimpleNamespace(samples=samples, rewards=torch.tensor(rewards), session_of_row=owners, env_metrics=metrics or {})


def test_rows_are_appended_per_chunk_and_kept_when_the_eval_stops(tmp_path, capsys):
    (tmp_path / PARTIAL_RESULTS).write_text('{"an earlier eval": 1}\n')
    chunks = EvalChunks(tmp_path / PARTIAL_RESULTS, num_prompts=4)
    assert (tmp_path / PARTIAL_RESULTS).read_text() == ""  # not mixed with an earlier eval's rows
    first = [{"prompt_index": 0, "correct": True}, {"prompt_index": 1, "correct": False}]
    chunks.add(2, rollout([1.0, 0.0], sessions=[0, 0], metrics={"env/x/calls": 2.0}), first, multi_turn=True)
    second = [{"prompt_index": 2, "correct": True}]
    chunks.add(3, rollout([1.0], sessions=[0], metrics={"env/x/calls": 3.0, "env/x/errors": 1.0}), second, multi_turn=True)
    assert [json.loads(line) for line in (tmp_path / PARTIAL_RESULTS).read_text().splitlines()] == first + second
    assert chunks.env_metrics == {"env/x/calls": 5.0, "env/x/errors": 1.0}  # summed over chunks
    # ... but an agent task's per-session means, which average over the chunks' sessions (a sum multiplied them)
    agents = EvalChunks(tmp_path / "agents.jsonl", num_prompts=2)
    for sessions, per_session in ((2.0, 1.0), (6.0, 2.0)):
        agents.add(1, rollout([1.0], metrics={"agent/sessions": sessions, "agent/rows_per_session": per_session}), [{}], multi_turn=False)
    assert agents.env_metrics == {"agent/sessions": 8.0, "agent/rows_per_session": (2 * 1.0 + 6 * 2.0) / 8}
    err = capsys.readouterr().err
    assert "[eval] 2/4 prompts (2 rows) | elapsed" in err and "[eval] 3/4 prompts (3 rows)" in err
    assert chunks.stopped_line() == (
        f"[eval] stopped after 3 of 4 prompts: their 3 rows are in {tmp_path / PARTIAL_RESULTS} (no summary.json)"
    )
    (tmp_path / "summary.json").write_text("{}")  # an earlier eval's, beside the partial rows
    assert chunks.stopped_line().endswith("(the summary.json and results.jsonl there are an earlier eval's)")
    # the episodes of both chunks, as one rollout of all their rows would give them (the first chunk's one branched)
    whole = rollout([1.0, 0.0, 1.0], sessions=[0, 0, 1])
    assert episode_metrics(chunks.episodes) == multi_turn_metrics(whole.samples, whole.rewards, session_of_row=[0, 0, 1])
    chunks.finish()
    assert not (tmp_path / PARTIAL_RESULTS).exists()


def test_a_partial_file_that_cannot_be_written_is_a_warning_not_a_stop(tmp_path):
    with pytest.warns(RuntimeWarning, match="a stopped eval will keep no rows"):
        chunks = EvalChunks(tmp_path / "missing" / PARTIAL_RESULTS, num_prompts=2)
    chunks.add(2, rollout([1.0]), [{"prompt_index": 0}], multi_turn=False)
    assert len(chunks.rows) == 1 and "rows are lost" in chunks.stopped_line()


def test_a_stopped_evals_rows_are_kept_aside_under_a_name_no_other_kept_rows_have(tmp_path):
    """Rows of two stopped evals whose last writes fell in the same second: the second replaced the first's kept file."""
    import os

    from nemo_like.evaluation.run import keep_stopped_rows

    assert keep_stopped_rows(tmp_path) is None  # nothing to keep
    (tmp_path / PARTIAL_RESULTS).write_text("")
    assert keep_stopped_rows(tmp_path) is None and (tmp_path / PARTIAL_RESULTS).exists()  # empty: nothing kept
    kept = []
    for rows in ("a\n", "b\n", "c\n"):
        (tmp_path / PARTIAL_RESULTS).write_text(rows)
        os.utime(tmp_path / PARTIAL_RESULTS, (1_700_000_000, 1_700_000_000))
        kept.append(keep_stopped_rows(tmp_path))
    assert [path.read_text() for path in kept] == ["a\n", "b\n", "c\n"] and not (tmp_path / PARTIAL_RESULTS).exists()
    assert [path.name.split(".")[2:] for path in kept][1:] == [
        [kept[0].name.split(".")[2], "2", "jsonl"],
        [kept[0].name.split(".")[2], "3", "jsonl"],
    ]
