"""One run per directory: the lock train() takes on logger.log_dir and checkpointing.checkpoint_dir,
held by a real second process (no full training run: the holder takes it through the same code)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from nemo_like.cli import main
from nemo_like.config import load_config
from nemo_like.utils.files import partial_path
from nemo_like.utils.run_lock import LOCK_FILE, RunLockError, hold_run_locks, run_directories

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml"

HOLDER = textwrap.dedent(
    """
    import sys
    from nemo_like.config import load_config
    from nemo_like.utils.run_lock import hold_run_locks, run_directories

    cfg = load_config(sys.argv[1], sys.argv[2:])
    with hold_run_locks(run_directories(cfg)):
        print("held", flush=True)
        sys.stdin.read()  # hold until the test closes stdin (or kills this process)
    print("released", flush=True)
    """
)


def overrides(tmp_path: Path) -> list[str]:
    return [
        f"logger.log_dir={tmp_path / 'logs'}",
        "checkpointing.enabled=true",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        "logger.progress_bar=false",
    ]


def start_holder(tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(TINY), *overrides(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture(scope="module")
def held_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("held")


@pytest.fixture(scope="module")
def holder(held_dir: Path):
    """One live holder process shared by the tests that only try to take its lock."""
    proc = start_holder(held_dir)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_second_run_on_held_directories_stops_naming_the_holder(held_dir, holder):
    tmp_path = held_dir
    cfg = load_config(TINY, overrides(tmp_path))
    with pytest.raises(RunLockError) as err:
        with hold_run_locks(run_directories(cfg)):
            pass
    msg = str(err.value)
    assert f"pid {holder.pid} on host {socket.gethostname()}, started " in msg
    assert f"logger.log_dir={tmp_path / 'logs'}" in msg and "in use by another run" in msg


def test_the_cli_stops_before_resuming_or_trimming_the_holders_files(held_dir, holder, capsys):
    tmp_path = held_dir
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    metrics = "".join(f'{{"step": {s}, "train/loss": 0.5}}\n' for s in (1, 2, 3))
    (logs / "metrics.jsonl").write_text(metrics)
    in_progress = ckpt / ".tmp_step_4"  # the holder's save in progress: a resuming run would delete it
    in_progress.mkdir()
    writing = partial_path(logs / "train_data_step_3.jsonl")  # the holder's sample dump before its rename
    writing.write_text("{}\n")

    assert main(["train", "--config", str(TINY), *overrides(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "logger.log_dir" in err and f"pid {holder.pid}" in err and "Traceback" not in err
    assert (logs / "metrics.jsonl").read_text() == metrics
    assert in_progress.is_dir() and writing.is_file()


def test_an_eval_into_a_held_directory_stops_naming_eval_output_dir(held_dir, holder, capsys):
    """Two evals (or an eval and a run) writing one directory left a summary beside another's rows: eval takes the lock
    too, before it starts anything."""
    assert main(["eval", "--config", str(TINY), f"eval.output_dir={held_dir / 'logs'}", "grpo.max_val_samples=4"]) == 1
    err = capsys.readouterr().err
    assert f"eval.output_dir={held_dir / 'logs'} is in use by another run: pid {holder.pid}" in err and "Traceback" not in err
    assert not (held_dir / "logs" / "summary.json").exists()


def test_the_checkpoint_dir_is_locked_too(held_dir, tmp_path, holder):
    cfg = load_config(TINY, [f"logger.log_dir={tmp_path / 'other_logs'}", *overrides(held_dir)[1:]])
    with pytest.raises(RunLockError, match=rf"checkpointing.checkpoint_dir={held_dir / 'ckpt'} is in use.*pid {holder.pid}"):
        with hold_run_locks(run_directories(cfg)):
            pass


def test_a_dead_holders_lock_is_taken_over_with_a_warning(tmp_path):
    proc = start_holder(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)  # no clean release: the holder record stays behind
    proc.wait()
    # ... nor a file it was writing when killed (replace_file's cleanup never ran), which stayed for ever
    left = tmp_path / "logs" / f".metrics.jsonl.{proc.pid}.0123abcd.tmp"
    left.write_text('{"step": 1}\n')
    writing = partial_path(tmp_path / "logs" / "results.jsonl")  # a live process's (an eval writing there): kept
    kept = [tmp_path / "logs" / ".notes.tmp", tmp_path / "logs" / ".metrics.jsonl.12.swp", writing]  # not the dead run's
    for path in kept:
        path.write_text("x")
    cfg = load_config(TINY, overrides(tmp_path))
    with pytest.warns(RuntimeWarning, match=rf"taking over the lock of a run that is gone \(pid {proc.pid} on host"):
        with hold_run_locks(run_directories(cfg)) as locks:
            assert not left.exists() and all(path.is_file() for path in kept)
            assert {lock.key for lock in locks} == {"logger.log_dir", "checkpointing.checkpoint_dir"}
            assert f'"pid": {os.getpid()}' in (tmp_path / "logs" / LOCK_FILE).read_text()
    # Released cleanly: the next run takes it silently.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hold_run_locks(run_directories(cfg)):
            pass


def test_a_cleanly_finished_holder_leaves_no_warning_and_one_dir_gets_one_lock(tmp_path):
    proc = start_holder(tmp_path)
    proc.stdin.close()
    assert proc.stdout.readline().strip() == "released"
    proc.wait()
    same = load_config(
        TINY, [f"logger.log_dir={tmp_path / 'd'}", "checkpointing.enabled=true", f"checkpointing.checkpoint_dir={tmp_path / 'd'}"]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hold_run_locks(run_directories(load_config(TINY, overrides(tmp_path)))):
            pass
        with hold_run_locks(run_directories(same)) as locks:  # log and checkpoint dir are one directory
            assert len(locks) == 1


def test_a_lock_file_this_run_cannot_open_is_an_error_naming_the_key(tmp_path):
    """It was an OSError traceback (another user's lock file at mode 0644 in a shared directory: EACCES; here, as root
    may open any file, something at the lock's path that is not a file)."""
    (tmp_path / LOCK_FILE).mkdir()
    with pytest.raises(RunLockError, match=rf"logger.log_dir={tmp_path}: cannot open the run lock {tmp_path / LOCK_FILE}: Is a directory"):
        with hold_run_locks({"logger.log_dir": tmp_path}):
            pass
