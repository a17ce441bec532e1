"""Checkpoint directory mechanics on real files: atomicity, discovery, retention, compatibility."""

import json
import os
import shutil
import subprocess
import uuid

import pytest

from nemo_like.utils.checkpoint import (
    CheckpointError,
    CheckpointManager,
    incompatible_differences,
    metric_key,
)


def write_blob(size: int):
    def write(tmp):
        (tmp / "blob.bin").write_bytes(os.urandom(size))

    return write


def test_save_is_atomic_and_partial_dirs_are_ignored_and_cleaned(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, write_blob(10), {"metrics": {}}, {"a": 1})
    partial = tmp_path / ".tmp_step_2_999"
    partial.mkdir()
    (partial / "blob.bin").write_bytes(b"half")
    broken = tmp_path / "step_3"  # a step dir without trainer_state.json is not a checkpoint
    broken.mkdir()
    assert [c.step for c in manager.valid_checkpoints()] == [1]
    assert manager.latest().step == 1
    assert manager.remove_partial_saves() == [partial] and not partial.exists()


def test_a_failing_writer_keeps_the_previous_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, write_blob(10), {"metrics": {}}, {})

    def fail(tmp):
        raise OSError(5, "Input/output error")

    with pytest.raises(CheckpointError, match="step_2 .* failed: .*previous checkpoint .*step_1 is kept"):
        manager.save(2, fail, {"metrics": {}}, {})
    assert [c.step for c in manager.valid_checkpoints()] == [1]
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_keep_top_k_by_metric_always_keeps_the_latest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_top_k=2, metric_name="val:accuracy")
    for step, acc in [(1, 0.5), (2, 0.9), (3, 0.7), (4, 0.1)]:
        manager.save(step, write_blob(1), {"metrics": {"validation/accuracy": acc}}, {})
    assert [c.step for c in manager.valid_checkpoints()] == [2, 3, 4]  # best two + the latest
    lower = CheckpointManager(tmp_path / "l", keep_top_k=1, metric_name="train:loss", higher_is_better=False)
    for step, loss in [(1, 0.3), (2, 0.1), (3, 0.2)]:
        lower.save(step, write_blob(1), {"metrics": {"train/loss": loss}}, {})
    assert [c.step for c in lower.valid_checkpoints()] == [2, 3]


def test_metric_key_and_incompatible_differences():
    assert metric_key("val:accuracy") == "validation/accuracy" and metric_key("train:reward") == "train/reward"
    with pytest.raises(ValueError):
        metric_key("accuracy")
    saved = {"policy": {"model_name": "a", "optimizer": {"lr": 1}}, "grpo": {"num_prompts_per_step": 8, "max_num_steps": 3}}
    current = {"policy": {"model_name": "b", "optimizer": {"lr": 2}}, "grpo": {"num_prompts_per_step": 4, "max_num_steps": 6}}
    diffs = incompatible_differences(saved, current)
    assert any(d.startswith("policy.model_name") for d in diffs)
    assert any(d.startswith("grpo.num_prompts_per_step") for d in diffs)
    assert not any("lr" in d or "max_num_steps" in d for d in diffs)


def test_full_disk_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", f"tmpfs-{uuid.uuid4().hex[:6]}", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.decode().strip()}")
    try:
        manager = CheckpointManager(mount / "ckpt")
        manager.save(1, write_blob(16 * 1024), {"metrics": {}}, {})
        with pytest.raises(CheckpointError, match="no space left on device.*step_1 is kept"):
            manager.save(2, write_blob(1024 * 1024), {"metrics": {}}, {})
        assert [c.step for c in manager.valid_checkpoints()] == [1]
        assert json.loads((mount / "ckpt" / "step_1" / "trainer_state.json").read_text())["step"] == 1
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
        shutil.rmtree(mount, ignore_errors=True)
