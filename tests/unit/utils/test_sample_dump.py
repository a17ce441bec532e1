"""Sample dump helpers: response-token slicing, per-sample means, JSONL records."""

import json
import math

import pytest
import torch

from nemo_like.utils.sample_dump import (
    dump_path,
    format_samples,
    per_sample_mean,
    response_token_values,
    sample_records,
    write_sample_dump,
)


def test_response_token_values_follow_the_mask_row_by_row():
    values = torch.tensor([[0.0, -1.0, -2.0, 9.0], [0.0, 9.0, -3.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0]])
    assert response_token_values(values, mask) == [[-1.0, -2.0], [-3.0]]


def test_per_sample_mean_ignores_masked_positions_and_empty_rows():
    values = torch.tensor([[5.0, 2.0, 2.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert per_sample_mean(values, mask) == [2.0, 0.0]


def test_records_are_json_safe_and_columns_must_agree(tmp_path):
    columns = {"reward": torch.tensor([1.0, 0.0]), "prev_logprobs": [[float("-inf"), -0.5], None], "prompt": ["a", "b"]}
    records = sample_records(3, columns)
    assert records[0] == {"step": 3, "index": 0, "reward": 1.0, "prev_logprobs": ["-inf", -0.5], "prompt": "a"}
    path = write_sample_dump(dump_path(tmp_path, "train", 3), 3, columns)
    assert path.name == "train_data_step3.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == records and lines[1]["prev_logprobs"] is None
    assert not math.isnan(lines[0]["reward"])
    with pytest.raises(ValueError, match="differ in length"):
        sample_records(0, {"a": [1, 2], "b": [1]})


def test_format_samples_shows_prompt_response_and_reward_of_the_first_few():
    text = format_samples(["p0", "p1", "p2"], ["r0", "r1", "r2"], [1.0, 0.0, 1.0], limit=2)
    assert "p0" in text and "r1" in text and "reward 0.000" in text and "p2" not in text


def test_a_replaced_file_keeps_its_permissions_and_a_symlink_stays_a_link(tmp_path):
    """replace_file gave a private (0600) or group-shared (0660) metrics.jsonl the umask's 0644, and replaced a symlink
    with a plain file, the link's target keeping its old data."""
    import os

    from nemo_like.utils.files import replace_file

    for mode in (0o600, 0o660):
        target = tmp_path / f"private_{mode:o}"
        target.write_text("old\n")
        target.chmod(mode)
        replace_file(target, "new\n")
        assert target.read_text() == "new\n" and target.stat().st_mode & 0o777 == mode
    elsewhere = tmp_path / "storage" / "metrics.jsonl"
    elsewhere.parent.mkdir()
    elsewhere.write_text("old\n")
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(elsewhere)
    assert replace_file(link, "new\n") == link
    assert link.is_symlink() and os.readlink(link) == str(elsewhere) and elsewhere.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["metrics.jsonl", "private_600", "private_660", "storage"])


def test_a_replaced_file_is_on_disk_before_its_rename_and_a_failed_one_leaves_the_old(tmp_path, monkeypatch):
    """replace_file renamed an unsynced `<name>.tmp` over the file (an OS crash could leave the name over an empty file)
    and two writers of one path shared that temporary name."""
    import errno
    import os

    from nemo_like.utils.files import replace_file

    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    target = tmp_path / "metrics.jsonl"
    replace_file(target, "a\n")
    assert target.read_text() == "a\n" and len(synced) == 2
    assert synced[0].startswith(str(tmp_path / ".metrics.jsonl.")) and synced[1] == str(tmp_path)  # the data, then the rename
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert target.stat().st_mode == plain.stat().st_mode  # the umask's permissions, as a plain write's

    # A filesystem that cannot fsync a directory (EINVAL: WSL1's drvfs, some network mounts): the file is replaced, no error
    def no_directory_fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", no_directory_fsync)
    replace_file(target, "a\n")
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        replace_file(target, b"b\n")
    assert target.read_text() == "a\n" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "plain"]
