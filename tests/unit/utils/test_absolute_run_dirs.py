"""A run's log and checkpoint directories are made absolute by the driver before any actor sees them."""

import json
from pathlib import Path

from nemo_like.config import DEFAULT_RECIPE, load_config


def test_train_hands_absolute_run_dirs_resolved_against_the_drivers_cwd(tmp_path, monkeypatch):
    """A relative checkpoint_dir went to the policy workers as it was: rank 0 resolved it against its own working
    directory (a joined cluster's, a submitted job's node-local copy) and wrote the weights there."""
    from nemo_like import train as train_module

    driver = tmp_path / "driver"
    driver.mkdir()
    monkeypatch.chdir(driver)
    cfg = load_config(
        DEFAULT_RECIPE, ["checkpointing.enabled=true", "checkpointing.checkpoint_dir=results/run1", "logger.log_dir=logs/run1"]
    )
    seen = []
    monkeypatch.setattr(train_module, "_train_locked", lambda cfg, *args: seen.append(cfg) or [])
    train_module.train(cfg)
    assert seen[0].checkpointing.checkpoint_dir == str(driver / "results" / "run1")
    assert seen[0].logger.log_dir == str(driver / "logs" / "run1")
    assert Path(seen[0].checkpointing.checkpoint_dir).is_absolute() and Path(seen[0].logger.log_dir).is_absolute()
    assert cfg.checkpointing.checkpoint_dir == "results/run1"  # the caller's config is left as it was
    elsewhere = train_module.absolute_run_dirs(seen[0], cwd=tmp_path / "other")  # an absolute path stays as it is
    assert (elsewhere.checkpointing.checkpoint_dir, elsewhere.logger.log_dir) == (
        seen[0].checkpointing.checkpoint_dir,
        seen[0].logger.log_dir,
    )


def test_relative_run_dirs_in_a_ray_job_are_warned_about(tmp_path, capsys):
    """In a submitted job a relative directory lands in Ray's unpacked working dir, deleted with the session."""
    from nemo_like import train as train_module
    from nemo_like.distributed.ray_env import JOB_CONFIG_VAR

    cfg = load_config(
        DEFAULT_RECIPE, ["checkpointing.enabled=true", "checkpointing.checkpoint_dir=results/run1", "logger.log_dir=/abs/logs"]
    )
    job = {JOB_CONFIG_VAR: json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"}, "metadata": {}})}
    unpacked = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"  # Ray's layout
    train_module.warn_relative_run_dirs_in_a_job(cfg, cwd=unpacked, environ=job)
    err = capsys.readouterr().err
    assert f"checkpointing.checkpoint_dir='results/run1' is relative: in this Ray job it is {unpacked / 'results/run1'}" in err
    assert "logger.log_dir" not in err  # absolute
    train_module.warn_relative_run_dirs_in_a_job(cfg, cwd=unpacked, environ={})  # not a job: the driver's cwd is the user's
    no_working_dir = {JOB_CONFIG_VAR: json.dumps({"runtime_env": {}, "metadata": {}})}  # it runs where `ray start` ran
    train_module.warn_relative_run_dirs_in_a_job(cfg, cwd=unpacked, environ=no_working_dir)
    train_module.warn_relative_run_dirs_in_a_job(cfg, cwd=tmp_path, environ=job)  # the entrypoint cd'd out of the copy
    off = load_config(DEFAULT_RECIPE, ["checkpointing.enabled=false", "logger.log_dir=/abs/logs"])
    train_module.warn_relative_run_dirs_in_a_job(off, cwd=unpacked, environ=job)  # nothing is saved
    assert capsys.readouterr().err == ""
