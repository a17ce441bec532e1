"""The registry of the runs alive on this machine: real processes holding real file locks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from nemo_like.utils.machine_runs import STALE_AFTER_S, SUFFIX, other_live_runs, registered_run

HOLDER = """
import sys
from pathlib import Path
from nemo_like.utils.machine_runs import registered_run
with registered_run(sys.argv[2], Path(sys.argv[1])):
    print("registered", flush=True)
    sys.stdin.readline()  # until the test closes stdin (a clean exit) or kills the process (a crash)
"""


def start_holder(directory: Path, log_dir: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), log_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "registered"
    return proc


def test_a_live_run_of_another_process_is_counted_until_it_ends_however_it_ends(tmp_path):
    runs = tmp_path / "runs"
    before = time.time()
    clean, crashed = start_holder(runs, "/logs/a"), start_holder(runs, "/logs/b")
    try:
        found = other_live_runs(runs)
        assert [(r.pid, r.directory) for r in found] == [(clean.pid, "/logs/a"), (crashed.pid, "/logs/b")]  # oldest first
        assert before <= found[0].started <= time.time() and f"pid {clean.pid}, started " in found[0].describe()
        with registered_run("/logs/mine", runs):  # this process's own run is not another
            assert [r.pid for r in other_live_runs(runs)] == [clean.pid, crashed.pid]
        clean.stdin.close()
        assert clean.wait(30) == 0
        crashed.kill()  # no clean-up ran: its file stays, but the kernel dropped its lock
        crashed.wait(30)
    finally:
        for proc in (clean, crashed):
            proc.kill()
            proc.wait(30)
    assert other_live_runs(runs) == []
    (left,) = runs.glob(f"*{SUFFIX}")  # the crashed run's; the clean exit removed its own and so did this process's run
    assert left.name.startswith(f"{crashed.pid}-")
    old = time.time() - STALE_AFTER_S - 1
    os.utime(left, (old, old))
    assert other_live_runs(runs) == [] and not left.exists()  # a stale file is removed by the next run that looks


def test_a_file_being_created_is_not_removed_and_an_unwritable_directory_does_not_fail_the_run(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    young = runs / f"1-x{SUFFIX}"
    young.write_text("")  # created, not yet locked: another run in its first instant
    assert other_live_runs(runs) == [] and young.exists()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with registered_run("/logs", blocked / "runs"):  # the directory cannot be made: the run goes on unregistered
        assert other_live_runs(blocked / "runs") == []


PINNED = """
import os, sys
from pathlib import Path
from nemo_like.utils.machine_runs import registered_run
os.sched_setaffinity(0, {int(sys.argv[3])})
with registered_run(sys.argv[2], Path(sys.argv[1])):
    print("registered", flush=True)
    sys.stdin.readline()
"""


def test_a_run_on_other_cpus_is_not_counted_and_storage_without_locks_fails_nothing(tmp_path, monkeypatch):
    """Jobs pinned to their own cores (Slurm's cgroups, taskset) were warned of each other and advised a fraction of
    their threads; a temp dir whose storage refuses flock (NFSv3 without lockd: ENOLCK) failed every run's set-up."""
    import errno

    import pytest

    from nemo_like.utils import machine_runs

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to pin two runs apart")
    runs = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, "-c", PINNED, str(runs), "/logs/pinned", str(cpus[1])], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "registered"
        assert [r.cpus for r in other_live_runs(runs)] == [frozenset({cpus[1]})]  # it may run on one of ours
        os.sched_setaffinity(0, {cpus[0]})
        try:
            assert other_live_runs(runs) == []  # on its own core
        finally:
            os.sched_setaffinity(0, cpus)
    finally:
        proc.kill()
        proc.wait(30)
    real_flock = machine_runs.fcntl.flock

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(machine_runs.fcntl, "flock", no_locks)
    with registered_run("/logs/mine", tmp_path / "nolocks"):
        assert list((tmp_path / "nolocks").iterdir()) == []  # unregistered: its file removed
    (tmp_path / "nolocks" / f"1-abc{SUFFIX}").write_text('{"pid": 1}')
    assert other_live_runs(tmp_path / "nolocks") == []  # nothing can be told: no error, nothing removed
    assert (tmp_path / "nolocks" / f"1-abc{SUFFIX}").exists()
    monkeypatch.setattr(machine_runs.fcntl, "flock", real_flock)
