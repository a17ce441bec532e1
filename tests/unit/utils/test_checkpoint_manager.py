"""Checkpoint directory mechanics on real files: atomicity, discovery, retention, compatibility."""

import json
import os
import shutil
import subprocess
import uuid
import warnings
from pathlib import Path

import pytest

from nemo_like.models.policy.checkpoints import checkpoint_files
from nemo_like.utils.checkpoint import (
    VALIDATED_AT_STEP,
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
    broken = tmp_path / "step_3"  # a step dir without trainer_state.json is not a checkpoint: skipped, named
    broken.mkdir()
    with pytest.warns(UserWarning, match=r"skipping .*step_3: its trainer_state.json cannot be read"):
        assert [c.step for c in manager.valid_checkpoints()] == [1]
    with pytest.warns(UserWarning):
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

    def fail_in_a_worker(tmp):  # the policy workers' writers fail as RayTaskError(RuntimeError): it escaped, temp kept
        (tmp / "half.pt").write_bytes(b"x")
        raise RuntimeError("ray::PolicyWorker.save_checkpoint()\nRuntimeError: [enforce fail at inline_container.cc] unexpected pos")

    with pytest.raises(CheckpointError, match="step_2 .* failed: RuntimeError: .*unexpected pos; the previous checkpoint"):
        manager.save(2, fail_in_a_worker, {"metrics": {}}, {})
    assert [c.step for c in manager.valid_checkpoints()] == [1]
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_a_save_whose_workers_wrote_nothing_here_is_refused_and_the_previous_checkpoint_kept(tmp_path):
    """A policy rank whose working directory differs from the driver's wrote a relative checkpoint_dir's weights into its
    own directory and returned without error: the driver renamed a step_N without weights into place, valid to latest()."""
    manager = CheckpointManager(tmp_path)
    manager.save(1, write_blob(10), {"metrics": {}}, {}, expected_files=())
    for lora in (False, True):
        with pytest.raises(
            CheckpointError, match=r"step_2 .* failed: the workers wrote no policy/.*optimizer\.pt .*absolute path .*every node"
        ):
            manager.save(2, lambda tmp: None, {"metrics": {}}, {}, expected_files=checkpoint_files(lora))
        assert [c.step for c in manager.valid_checkpoints()] == [1] and not (tmp_path / "step_2").exists()
        assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".nemo_like.lock") == ["step_1"]
        assert (tmp_path / "step_1" / "blob.bin").stat().st_size == 10


def test_keep_top_k_by_metric_always_keeps_the_latest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_top_k=2, metric_name="val:accuracy")
    for step, acc in [(1, 0.5), (2, 0.9), (3, 0.7), (4, 0.1)]:
        manager.save(step, write_blob(1), {"metrics": {"validation/accuracy": acc}}, {})
    assert [c.step for c in manager.valid_checkpoints()] == [2, 3, 4]  # best two + the latest
    lower = CheckpointManager(tmp_path / "l", keep_top_k=1, metric_name="train:loss", higher_is_better=False)
    for step, loss in [(1, 0.3), (2, 0.1), (3, 0.2)]:
        lower.save(step, write_blob(1), {"metrics": {"train/loss": loss}}, {})
    assert [c.step for c in lower.valid_checkpoints()] == [2, 3]
    # A NaN (what a skipped non-finite step logs as train/loss) ranks below every number: NaN compares false with
    # everything, so the sort put it anywhere and the best checkpoint (step 5) was deleted.
    nan = CheckpointManager(tmp_path / "n", keep_top_k=1, metric_name="train:loss", higher_is_better=False)
    for step, loss in enumerate([float("nan"), 0.55, float("nan"), float("nan"), 0.32, float("nan"), float("nan")], start=1):
        nan.save(step, write_blob(1), {"metrics": {"train/loss": loss}}, {})
    assert [c.step for c in nan.valid_checkpoints()] == [5, 7]
    # Another run's later checkpoints (a resume=false run in the same directory): the newest on disk, step_100, ranks
    # worst but stays (the latest is what a resume reads), and so does the step just written.
    other = CheckpointManager(tmp_path / "o", keep_top_k=3, metric_name="val:accuracy")
    for step, acc in [(80, 0.9), (90, 0.8), (100, 0.1)]:
        other.save(step, write_blob(1), {"metrics": {"validation/accuracy": acc}}, {})
    fresh = CheckpointManager(tmp_path / "o", keep_top_k=2, metric_name="val:accuracy")
    fresh.save(10, write_blob(1), {"metrics": {"validation/accuracy": 0.5}}, {})
    assert [c.step for c in fresh.valid_checkpoints()] == [10, 80, 90, 100]


def test_a_save_fsyncs_every_file_and_directory_before_its_rename_and_a_failed_resave_keeps_the_old_copy(tmp_path, monkeypatch):
    """checkpointing.md promises a checkpoint fsynced whole before it appears under its name; and a re-save whose final
    rename failed had left the earlier complete copy of the step under a temporary name (reported: an older step)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    manager = CheckpointManager(tmp_path)
    final = manager.save(1, write_blob(1), {"metrics": {}}, {})
    written = sorted(str(p.relative_to(final)) for p in final.rglob("*"))
    tmp_name = next(Path(p).name for p in synced if Path(p).name.startswith(".tmp"))
    synced_inside = {str(Path(p).relative_to(tmp_path / tmp_name)) for p in synced if tmp_name in p and Path(p).name != tmp_name}
    assert set(written) <= synced_inside, (written, synced)  # every file and subdirectory, under the temporary name
    assert synced[-1] == str(tmp_path) and synced.index(str(tmp_path)) > synced.index(str(tmp_path / tmp_name))
    monkeypatch.setattr(os, "fsync", real_fsync)
    real_rename = os.rename

    def failing_rename(src, dst):
        if Path(src).name.startswith(".tmp") and Path(dst).name == "step_1" and "replaced" not in Path(src).name:
            raise OSError(5, "Input/output error")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(CheckpointError, match=r"step_1 in .* failed: .*Input/output error; the previous checkpoint .*step_1 is kept"):
        manager.save(1, write_blob(2), {"metrics": {}}, {})
    assert [c.step for c in manager.valid_checkpoints()] == [1] and (tmp_path / "step_1" / "blob.bin").stat().st_size == 1


def test_a_tie_keeps_the_checkpoint_whose_weights_the_validation_measured(tmp_path):
    """Validation at step 2 (0.8) carries on into the saves of steps 3 and 4 until the next one: best-1 by it keeps
    step 2, the validated weights (a tie went to the later step, weights never validated), and the latest."""
    manager = CheckpointManager(tmp_path, keep_top_k=1, metric_name="val:accuracy")
    for step, measured in [(1, 1), (2, 2), (3, 2), (4, 2)]:
        acc = {1: 0.5, 2: 0.8}[measured]
        manager.save(step, write_blob(1), {"metrics": {"validation/accuracy": acc, VALIDATED_AT_STEP: float(measured)}}, {})
    assert [c.step for c in manager.valid_checkpoints()] == [2, 4]


def test_a_fresh_run_keeps_the_checkpoint_it_just_wrote_beside_another_runs_later_ones(tmp_path):
    """checkpointing.resume=false into a directory holding another run's step_80..100: the new step_10 is kept (it
    was deleted as soon as written: "the latest" was the other run's step_100)."""
    other = CheckpointManager(tmp_path, keep_top_k=3)
    for step in (80, 90, 100):
        other.save(step, write_blob(1), {"metrics": {}}, {"run": "old"})
    fresh = CheckpointManager(tmp_path, keep_top_k=3)
    path = fresh.save(10, write_blob(1), {"metrics": {}}, {"run": "new"})
    assert path.exists() and [c.step for c in fresh.valid_checkpoints()] == [10, 80, 90, 100]  # the top 3, and the new one
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())  # the pruned one left no half behind


def test_re_saving_a_step_replaces_it_by_renames_so_no_half_deleted_copy_reads_as_complete(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(5, write_blob(10), {"metrics": {}, "copy": 1}, {})
    removed_while_visible = []
    real_rmtree = shutil.rmtree

    def rmtree_watching(path, *args, **kwargs):  # what a crash inside the delete would leave behind
        removed_while_visible.append(os.path.basename(path))
        return real_rmtree(path, *args, **kwargs)

    shutil.rmtree = rmtree_watching
    try:
        manager.save(5, write_blob(10), {"metrics": {}, "copy": 2}, {})
    finally:
        shutil.rmtree = real_rmtree
    assert "step_5" not in removed_while_visible  # the old copy is deleted under a temporary name only
    assert [(c.step, c.state["copy"]) for c in manager.valid_checkpoints()] == [(5, 2)]
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_a_resave_killed_between_its_two_renames_keeps_step_n(tmp_path, monkeypatch, capsys):
    """The old step_N set aside, the new copy not yet renamed in: both carried temporary names and the next start
    deleted both, losing a checkpoint that was complete before and after the save."""
    manager = CheckpointManager(tmp_path)
    for step in (2, 4):
        manager.save(step, write_blob(10), {"metrics": {}, "copy": 1}, {})
    real_rename = os.rename

    class Killed(BaseException):
        pass

    def rename_killed_before_the_new_copy(src, dst):
        if os.path.basename(dst) == "step_4" and not str(src).endswith("_replaced"):
            raise Killed  # SIGKILL between the two renames: the old copy is already aside
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_killed_before_the_new_copy)
    with pytest.raises(Killed):
        manager.save(4, write_blob(10), {"metrics": {}, "copy": 2}, {})
    monkeypatch.setattr(os, "rename", real_rename)
    assert not (tmp_path / "step_4").exists()

    removed = CheckpointManager(tmp_path).remove_partial_saves()
    latest = CheckpointManager(tmp_path).latest()
    assert latest is not None and latest.step == 4 and latest.state["copy"] == 2  # the new copy: it was complete
    assert [p.name for p in removed] == [f".tmp_step_4_{os.getpid()}_replaced"]
    assert "restored" in capsys.readouterr().err
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())

    # The new copy incomplete (no state file): the set-aside old copy is restored instead. A pruned copy stays deleted.
    (tmp_path / "step_4").rename(tmp_path / ".tmp_step_4_77_replaced")
    (tmp_path / ".tmp_step_4_77").mkdir()
    (tmp_path / "step_2").rename(tmp_path / ".tmp_step_2_77_pruned")
    CheckpointManager(tmp_path).remove_partial_saves()
    assert [(c.step, c.state["copy"]) for c in CheckpointManager(tmp_path).valid_checkpoints()] == [(4, 2)]
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_metric_key_and_incompatible_differences():
    assert metric_key("val:accuracy") == "validation/accuracy" and metric_key("train:reward") == "train/reward"
    for bad in ("accuracy", "val:", "valid:accuracy"):
        with pytest.raises(ValueError, match=rf"checkpointing.metric_name must look like 'val:<metric>'.*got '{bad}'"):
            metric_key(bad)
    saved = {"policy": {"model_name": "a", "optimizer": {"lr": 1}}, "grpo": {"num_prompts_per_step": 8, "max_num_steps": 3}}
    current = {"policy": {"model_name": "b", "optimizer": {"lr": 2}}, "grpo": {"num_prompts_per_step": 4, "max_num_steps": 6}}
    diffs = incompatible_differences(saved, current)
    assert any(d.startswith("policy.model_name") for d in diffs)
    assert any(d.startswith("grpo.num_prompts_per_step") for d in diffs)
    assert not any("lr" in d or "max_num_steps" in d for d in diffs)
    # Validation data may change on resume (the shipped recipes tie data.validation.num_problems to
    # grpo.max_val_samples: any validation change was refused); the training stream and the carved fraction may not.
    data = {"train": {"num_problems": 100}, "validation": {"num_problems": 256, "split_fraction": None}, "shuffle": True}
    assert incompatible_differences({"data": data}, {"data": {**data, "validation": {"num_problems": 64, "split_fraction": None}}}) == []
    for changed in ({"train": {"num_problems": 50}}, {"shuffle": False}, {"validation": {"num_problems": 256, "split_fraction": 0.1}}):
        assert incompatible_differences({"data": data}, {"data": {**data, **changed}}), changed


def test_an_async_checkpoints_buffer_pins_its_bound_and_sampling_settings_and_a_sync_one_does_not():
    """The replay buffer holds samples paced for the bound and drawn (pi_gen) at the saved temperature/top-p/top-k: a
    resume with other values trained them under an importance weight that measured the change, not staleness. A sync
    checkpoint holds no samples: its async keys (no effect there) refused the resume."""

    def config(enabled: bool, age: int = 1, temperature: float = 1.0, top_k: int | None = None) -> dict:
        return {
            "grpo": {"async_grpo": {"enabled": enabled, "max_trajectory_age_steps": age}},
            "policy": {"generation": {"temperature": temperature, "top_p": 1.0, "top_k": top_k}},
        }

    assert incompatible_differences(config(True), config(True, temperature=0.6)) == ["policy.generation.temperature: 1.0 -> 0.6"]
    assert incompatible_differences(config(True), config(True, top_k=20)) == ["policy.generation.top_k: None -> 20"]
    assert incompatible_differences(config(True), config(True, age=2)) == ["grpo.async_grpo.max_trajectory_age_steps: 1 -> 2"]
    assert incompatible_differences(config(False), config(False, age=3, temperature=0.6)) == []


def test_a_lora_checkpoint_pins_its_adapters_shape_and_a_full_one_does_not():
    """A full fine-tuning checkpoint was refused over policy.lora_cfg.dim / target_modules, keys the config loader
    itself warns have no effect with LoRA off."""

    def config(enabled: bool, dim: int = 8, targets: list[str] | None = None) -> dict:
        return {"policy": {"lora_cfg": {"enabled": enabled, "dim": dim, "alpha": 16, "target_modules": targets, "exclude_modules": None}}}

    assert incompatible_differences(config(False), config(False, dim=4, targets=["q_proj"])) == []
    assert incompatible_differences(config(True), config(True, dim=4)) == ["policy.lora_cfg.dim: 8 -> 4"]
    assert incompatible_differences(config(True), config(True, targets=["q_proj"])) == [
        "policy.lora_cfg.target_modules: None -> ['q_proj']"
    ]
    assert incompatible_differences(config(False), config(True)) == ["policy.lora_cfg.enabled: False -> True"]
    # The same modules listed in another order are the same adapters (the resume was refused)
    assert incompatible_differences(config(True, targets=["q_proj", "v_proj"]), config(True, targets=["v_proj", "q_proj"])) == []
    assert incompatible_differences(config(True, targets=["q_proj", "v_proj"]), config(True, targets=["q_proj"]))
    # exclude_modules: null and [] exclude nothing alike (exclude_modules=[] refused a checkpoint saved with null)
    excluding = config(True)
    excluding["policy"]["lora_cfg"]["exclude_modules"] = []
    assert incompatible_differences(config(True), excluding) == []
    excluding["policy"]["lora_cfg"]["exclude_modules"] = ["layers.0.mlp"]
    assert incompatible_differences(config(True), excluding) == ["policy.lora_cfg.exclude_modules: None -> ['layers.0.mlp']"]


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
        import torch

        def torch_save(tmp):  # what the policy workers write: torch.save raises a RuntimeError ("unexpected pos")
            torch.save({"w": torch.zeros(256 * 1024)}, tmp / "optimizer.pt")

        with pytest.raises(CheckpointError, match="no space left on device.*step_1 is kept"):
            manager.save(2, torch_save, {"metrics": {}}, {})
        assert [c.step for c in manager.valid_checkpoints()] == [1]
        assert not any(p.name.startswith(".tmp") for p in (mount / "ckpt").iterdir())
        assert json.loads((mount / "ckpt" / "step_1" / "trainer_state.json").read_text())["step"] == 1
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
        shutil.rmtree(mount, ignore_errors=True)


def test_resume_names_a_damaged_config_and_an_async_checkpoint_without_its_buffer(tmp_path):
    from nemo_like.algorithms.checkpointing import find_resume_checkpoint
    from nemo_like.algorithms.grpo import restored_async_state
    from nemo_like.config import load_config

    manager = CheckpointManager(tmp_path / "ck")
    manager.save(3, write_blob(1), {"metrics": {}, "async": {"next_target": 5}}, {"a": 1})
    (tmp_path / "ck" / "step_3" / "config.yaml").write_text("grpo: [unclosed")
    cfg = load_config(None, ["checkpointing.enabled=true", f"checkpointing.checkpoint_dir={tmp_path / 'ck'}", "checkpointing.resume=true"])
    with pytest.raises(CheckpointError, match=r"step_3/config.yaml cannot be read"):
        find_resume_checkpoint(cfg)
    with pytest.raises(CheckpointError, match=r"step_3 has no replay_buffer.pt: an async run resumes its replay buffer"):
        restored_async_state(manager.latest())  # its loader position is ahead by the buffered batches: never skip them


def test_a_fresh_run_is_refused_where_another_runs_checkpoints_are(tmp_path):
    """checkpointing.resume=false (which every refusal advised) in a directory holding another run's step_2..4: the fresh
    run saved its step_2 over the other's without a word, keep_top_k pruned the two runs' checkpoints together, and a
    later resume took the newest of either run (another run's weights under this run's config)."""
    from nemo_like.algorithms.checkpointing import find_resume_checkpoint
    from nemo_like.config import load_config

    ck = tmp_path / "ck"
    fresh = load_config(
        None, ["checkpointing.enabled=true", f"checkpointing.checkpoint_dir={ck}", "checkpointing.resume=false"], warn=False
    )
    assert find_resume_checkpoint(fresh) is None  # nothing there yet: a fresh run
    for step in range(2, 8):
        CheckpointManager(ck).save(step, write_blob(1), {"metrics": {}}, {})
    with pytest.raises(CheckpointError) as refused:
        find_resume_checkpoint(fresh)
    assert str(refused.value) == (
        f"checkpointing.resume=false starts a fresh run, but checkpointing.checkpoint_dir={ck} holds an earlier run's "
        "checkpoints (step_2, step_3, ..., step_7 (6 in all)): the fresh run would save over those of the same steps and "
        "prune them as its own, and a later resume would take the newest of either run. Use another "
        "checkpointing.checkpoint_dir or move those away (drop checkpointing.resume=false to resume them)"
    )
    assert sorted(p.name for p in ck.iterdir()) == [f"step_{s}" for s in range(2, 8)]  # nothing touched


def test_a_ranking_metric_that_the_saves_never_hold_warns_once_with_the_logged_names(tmp_path):
    """checkpointing.metric_name=val:acc (a typo): every checkpoint ranked as if unmeasured and the top-k silently kept
    the latest ones; the first save whose metrics hold other validation metrics now says so."""
    manager = CheckpointManager(tmp_path, keep_top_k=1, metric_name="val:acc")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(1, write_blob(1), {"metrics": {"train/loss": 0.5}}, {})  # no validation yet: nothing to say
        assert not caught
        manager.save(2, write_blob(1), {"metrics": {"validation/accuracy": 0.9, "validation/pass@1": 0.9}}, {})
        manager.save(3, write_blob(1), {"metrics": {"validation/accuracy": 0.1}}, {})
    assert [str(w.message) for w in caught] == [
        "checkpointing.metric_name='val:acc': step_2's metrics have no 'validation/acc', so checkpoints are kept by step, "
        "not by that metric. Did you mean 'val:accuracy'? (logged: val:accuracy, val:pass@1)"
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        good = CheckpointManager(tmp_path / "good", keep_top_k=1, metric_name="val:accuracy")
        good.save(1, write_blob(1), {"metrics": {"validation/accuracy": 0.9}}, {})
        CheckpointManager(tmp_path / "all", keep_top_k=None, metric_name="val:acc").save(
            1, write_blob(1), {"metrics": {"validation/a": 1}}, {}
        )
    assert not caught  # the metric is there; or nothing is pruned, so nothing is ranked


def test_rerunning_a_finished_run_starts_nothing_unless_its_last_validation_is_missing(tmp_path, capsys):
    """The same command run again on a finished run started every actor, trained nothing and exited 0 (minutes of
    model and engine loading on a GPU). A checkpoint at grpo.max_num_steps that holds its end-of-run validation now
    ends the run before anything starts; one saved before that validation still resumes (to validate)."""
    from nemo_like.algorithms.checkpointing import checkpoint_files, find_resume_checkpoint, run_is_complete
    from nemo_like.config import load_config
    from nemo_like.train import train
    from nemo_like.utils.checkpoint import VALIDATED_AT_STEP

    ck = tmp_path / "ck"
    overrides = ["checkpointing.enabled=true", f"checkpointing.checkpoint_dir={ck}", f"logger.log_dir={tmp_path / 'log'}"]
    cfg = load_config(None, [*overrides, "grpo.max_num_steps=3"], warn=False)

    def write(tmp):
        for name in (*checkpoint_files(False), "worker_rng.pt"):
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(b"")

    CheckpointManager(ck).save(3, write, {"metrics": {"train/reward": 0.5}, "step": 3}, cfg.model_dump(mode="json"))
    assert not run_is_complete(cfg, find_resume_checkpoint(cfg))  # saved before its end-of-run validation
    assert run_is_complete(load_config(None, [*overrides, "grpo.max_num_steps=3", "grpo.val_at_end=false"], warn=False),
                           find_resume_checkpoint(cfg))  # fmt: skip
    assert not run_is_complete(load_config(None, [*overrides, "grpo.max_num_steps=4"], warn=False), find_resume_checkpoint(cfg))
    metrics = {"train/reward": 0.5, "validation/accuracy": 0.9, VALIDATED_AT_STEP: 3.0}
    CheckpointManager(ck).save(3, write, {"metrics": metrics, "step": 3}, cfg.model_dump(mode="json"))
    assert run_is_complete(cfg, find_resume_checkpoint(cfg))
    assert train(cfg) == []  # before Ray: this test has no cluster
    assert "step_3 is at grpo.max_num_steps=3: the run is complete, nothing to train" in capsys.readouterr().err


def test_resume_refuses_an_incomplete_a_damaged_or_a_too_late_checkpoint_naming_it(tmp_path):
    """A truncated optimizer.pt or worker RNG file stopped the resume with a worker's traceback naming no checkpoint,
    and a checkpoint past grpo.max_num_steps trained nothing and exited 0."""
    import types

    from nemo_like.algorithms.checkpointing import checkpoint_files, find_resume_checkpoint, restore_run
    from nemo_like.config import load_config

    ck = tmp_path / "ck"
    cfg = load_config(None, ["checkpointing.enabled=true", f"checkpointing.checkpoint_dir={ck}", "grpo.max_num_steps=4"], warn=False)
    files = (*checkpoint_files(False), "worker_rng.pt")

    def write(tmp):
        for name in files[1:]:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(b"PK\x03\x04 truncated")

    CheckpointManager(ck).save(3, write, {"metrics": {}, "step": 3}, cfg.model_dump(mode="json"))
    with pytest.raises(CheckpointError, match=rf"step_3 is incomplete: no {files[0]}\. Move it away"):
        find_resume_checkpoint(cfg)
    (ck / "step_3" / files[0]).write_bytes(b"")
    checkpoint = find_resume_checkpoint(cfg)
    with pytest.raises(CheckpointError, match=r"step_3 cannot be resumed: \w+Error: .*Move it away"):
        restore_run(types.SimpleNamespace(), checkpoint)  # the driver reads worker_rng.pt first: damaged
    late = load_config(None, ["checkpointing.enabled=true", f"checkpointing.checkpoint_dir={ck}", "grpo.max_num_steps=2"], warn=False)
    with pytest.raises(CheckpointError, match=r"step_3 is at step 3, past grpo.max_num_steps=2: nothing to train"):
        find_resume_checkpoint(late)
    # LoRA turned on at resume: the key is named (it said "incomplete: no adapter files ... move it away", and the
    # step before had the same problem)
    lora = load_config(None, ["checkpointing.enabled=true", f"checkpointing.checkpoint_dir={ck}", "grpo.max_num_steps=4",
                              "policy.lora_cfg.enabled=true"], warn=False)  # fmt: skip
    with pytest.raises(CheckpointError, match=r"incompatible config; differing keys: policy.lora_cfg.enabled"):
        find_resume_checkpoint(lora)
    # An async checkpoint without its replay buffer: refused here, before the metrics are trimmed and the actors start
    # (it was refused only once every actor had started and the weights were loaded)
    overrides = [
        "checkpointing.enabled=true",
        f"checkpointing.checkpoint_dir={ck}",
        "grpo.max_num_steps=9",
        "grpo.async_grpo.enabled=true",
        "loss_fn.use_importance_sampling_correction=true",
    ]
    run_async = load_config(None, overrides, warn=False)
    CheckpointManager(ck).save(5, lambda tmp: [(tmp / n).parent.mkdir(parents=True, exist_ok=True) or (tmp / n).write_bytes(b"") for n in files],
                               {"metrics": {}, "step": 5}, run_async.model_dump(mode="json"))  # fmt: skip
    with pytest.raises(CheckpointError, match=r"step_5 is incomplete: no replay_buffer.pt\. Move it away"):
        find_resume_checkpoint(run_async)
    (ck / "step_5" / "replay_buffer.pt").write_bytes(b"")
    assert find_resume_checkpoint(run_async).step == 5


def test_a_policy_worker_that_dies_while_saving_restarts_the_run(tmp_path):
    """The save is the memory peak (rank 0 gathers weights and optimizer state): a policy death there came out as a
    CheckpointError, which no restart reads, and the run stopped; restore_run already let such a death through."""
    import types

    from nemo_like.algorithms.checkpointing import save_run
    from nemo_like.algorithms.restarts import dead_role
    from nemo_like.config import load_config
    from nemo_like.distributed.worker_group import WorkerFailure

    ck = tmp_path / "ck"
    cfg = load_config(None, ["checkpointing.enabled=true", f"checkpointing.checkpoint_dir={ck}"], warn=False)
    death = WorkerFailure("Ray actor p0 died during 'policy: checkpoint save'", "policy", "p0")

    class DyingPolicy:  # stands for the policy's worker group: its rank 0 dies while writing
        weight_version = 2

        def save_checkpoint(self, path):
            raise death

    loader = types.SimpleNamespace(state_dict=lambda: {"consumed": 8, "epoch": 0})
    parts = types.SimpleNamespace(policy=DyingPolicy(), tokenizer=None, train_loader=loader, cfg=cfg)
    with pytest.raises(WorkerFailure) as caught:
        save_run(parts, CheckpointManager(ck), 2, {})
    assert caught.value is death and dead_role(caught.value, {"policy": {"p0"}}) == "policy"
    assert not list(ck.iterdir())  # the partial save is gone


def test_changed_training_prompts_are_refused_before_set_up_and_before_the_log_is_trimmed(tmp_path, monkeypatch):
    """The fingerprint check ran in restore_run, once Ray and every actor had started and the weights had loaded, and
    after metrics.jsonl had lost the records past the checkpoint: data appended to the training file (the same path)
    cost a cluster start and the log."""
    import nemo_like.train as train_module
    from nemo_like.algorithms.checkpointing import checkpoint_files
    from nemo_like.config import load_config
    from nemo_like.config.errors import ConfigError

    ck, logs = tmp_path / "ck", tmp_path / "logs"
    overrides = ["checkpointing.enabled=true", f"checkpointing.checkpoint_dir={ck}", f"logger.log_dir={logs}", "grpo.max_num_steps=6"]
    cfg = load_config(None, overrides, warn=False)
    files = (*checkpoint_files(False), "worker_rng.pt")
    state = {"metrics": {}, "step": 3, "dataloader": {"epoch": 0, "index": 12, "consumed": 12, "fingerprint": "not-these-prompts"}}
    CheckpointManager(ck).save(
        3, lambda tmp: [(tmp / n).parent.mkdir(parents=True, exist_ok=True) or (tmp / n).write_bytes(b"") for n in files],
        state, cfg.model_dump(mode="json"),
    )  # fmt: skip
    logs.mkdir()
    logged = "".join(json.dumps({"step": s, "train/loss": 0.1}) + "\n" for s in range(1, 6))
    (logs / "metrics.jsonl").write_text(logged)

    def no_set_up(*args, **kwargs):
        raise AssertionError("set-up started (Ray, actors, weights) before the prompts were checked")

    monkeypatch.setattr(train_module, "setup_grpo", no_set_up)
    with pytest.raises(ConfigError, match=r"The training prompts differ from the ones the checkpoint was trained on"):
        train_module.train(cfg)
    assert (logs / "metrics.jsonl").read_text() == logged  # steps 4 and 5 are still there

    # A model the recipe cannot run is refused before the prompts are built (minutes for a large data set), as a fresh
    # run refuses it: the resume path tokenised every prompt first.
    bad_model = load_config(None, [*overrides, "policy.dtensor_cfg.tensor_parallel_size=4"], warn=False)
    import nemo_like.algorithms.setup as setup_module

    def no_prompts(*args, **kwargs):
        raise AssertionError("the prompts were built before the model was checked")

    monkeypatch.setattr(setup_module, "build_prompt_dataset", no_prompts)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4 must divide num_attention_heads=4"):
        train_module.train(bad_model)


def test_a_saved_policy_stops_where_the_run_stopped(tmp_path):
    """policy/'s generation_config.json held the base model's eos only: plain transformers generate on the copy ran
    past the token the run ended responses on (the tokenizer's eos, with policy.tokenizer_name naming another)."""
    import shutil

    from transformers import GenerationConfig

    from nemo_like.algorithms.checkpointing import write_stop_ids
    from nemo_like.models.assets import embedded_model_path
    from nemo_like.plan.run_plan import decide_run_plan

    copy = tmp_path / "policy"
    copy.mkdir()
    shutil.copy(Path(embedded_model_path("embedded:tiny-arith-qwen2")) / "generation_config.json", copy)
    assert GenerationConfig.from_pretrained(copy).eos_token_id == 2
    write_stop_ids(copy, (2, 0))
    saved = GenerationConfig.from_pretrained(copy)
    assert saved.eos_token_id == [2, 0] and saved.pad_token_id == 0  # the rest kept
    write_stop_ids(tmp_path, (7,))  # a model without one gets one
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == 7
    from nemo_like.config import load_config

    stops = load_config(None, ["policy.generation.stop_token_ids=[5, 2]"], warn=False)  # a stop id ends responses too
    assert decide_run_plan(stops, (2, 0), cpus_per_node=2).end_of_response_ids == (2, 0, 5)  # decided once
    # A base's own config that sets temperature without do_sample loads (a logged note) but save_pretrained refuses it:
    # every checkpoint of a run on such a base failed
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.7, "top_p": 0.8, "eos_token_id": 2}')
    write_stop_ids(tmp_path, (2, 5))
    saved = GenerationConfig.from_pretrained(tmp_path)
    assert saved.eos_token_id == [2, 5] and saved.temperature == 0.7


def test_a_lora_checkpoint_resumes_when_its_modules_are_spelled_otherwise(tmp_path):
    """target_modules: null (every decoder linear layer) and the list of those layers are the same adapters: resuming
    across the two spellings was refused as an incompatible config. Other modules are still refused."""
    from peft import get_peft_model

    from nemo_like.algorithms.checkpointing import checkpoint_files, find_resume_checkpoint
    from nemo_like.config import load_config
    from nemo_like.models import lora
    from nemo_like.models.loading import load_causal_lm

    ck = tmp_path / "ck"
    base = ["checkpointing.enabled=true", f"checkpointing.checkpoint_dir={ck}", "policy.lora_cfg.enabled=true"]
    saved_cfg = load_config(None, [*base, "policy.lora_cfg.target_modules=null"], warn=False)
    model = load_causal_lm(saved_cfg.policy.model_name)
    targets = lora.resolve_target_modules(model, saved_cfg.policy.lora_cfg)
    adapted = get_peft_model(model, lora.peft_config(saved_cfg.policy.lora_cfg, targets))

    def write(tmp):
        for name in (*checkpoint_files(True), "worker_rng.pt"):
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(b"")
        (tmp / "policy" / lora.ADAPTER_CONFIG).write_text(json.dumps(lora.adapter_config_dict(adapted)))

    CheckpointManager(ck).save(2, write, {"metrics": {}, "step": 2}, saved_cfg.model_dump(mode="json"))
    short = sorted({t.rsplit(".", 1)[-1] for t in targets})  # q_proj, k_proj, ...: every linear layer, by short name
    for same in (f"policy.lora_cfg.target_modules={short}", f"policy.lora_cfg.target_modules={short[::-1]}"):
        assert find_resume_checkpoint(load_config(None, [*base, same], warn=False)).step == 2, same
    for other in ("policy.lora_cfg.target_modules=[q_proj]", "policy.lora_cfg.exclude_modules=[layers.0.mlp.down_proj]"):
        with pytest.raises(CheckpointError, match=r"incompatible config; differing keys: policy\.lora_cfg\."):
            find_resume_checkpoint(load_config(None, [*base, other], warn=False))
    # A checkpoint whose adapters PEFT put on fused experts (target_parameters: written before such layers were left
    # out) passed this check and failed in the policy actor ("does not match the model: unexpected=[...experts...]")
    config = json.loads((ck / "step_2" / "policy" / lora.ADAPTER_CONFIG).read_text())
    (ck / "step_2" / "policy" / lora.ADAPTER_CONFIG).write_text(json.dumps({**config, "target_parameters": ["gate_up_proj", "down_proj"]}))
    for spelling in ("policy.lora_cfg.target_modules=null", f"policy.lora_cfg.target_modules={short}"):
        with pytest.raises(CheckpointError, match=r"its adapters sit on fused expert parameters \(down_proj, gate_up_proj\)"):
            find_resume_checkpoint(load_config(None, [*base, spelling], warn=False))
