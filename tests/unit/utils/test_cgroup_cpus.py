"""A cgroup CPU quota (docker --cpus=2, a Kubernetes CPU limit) caps the CPUs a run counts, though the CPU affinity and
os.cpu_count() still report the whole host."""

from __future__ import annotations

import pytest

from nemo_like.config import DEFAULT_RECIPE, load_config
from nemo_like.utils import cpus


@pytest.fixture
def host_of_64(monkeypatch, tmp_path):
    """A 64-core host; the cgroup files are read from ``tmp_path`` (written by each test)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setattr(cpus, "CGROUP_ROOT", tmp_path, raising=False)
    monkeypatch.setattr(cpus, "SELF_CGROUP", tmp_path / "self_cgroup", raising=False)  # unless a test writes it: the top cgroup
    return tmp_path


def test_a_two_cpu_quota_gives_the_private_cluster_and_the_thread_split_two_cpus(host_of_64) -> None:
    """The private cluster was started with os.cpu_count() CPUs and the thread split made for 64 CPUs: 64 threads per
    phase on 2 CPUs' worth of time (Ray's own detection honours the quota; the run overrode it)."""
    from nemo_like.distributed.ray_init import local_init_kwargs
    from nemo_like.distributed.threads import node_cpus

    (host_of_64 / "cpu.max").write_text("200000 100000\n")  # cgroup v2: 2 CPUs
    cluster = load_config(DEFAULT_RECIPE, [], warn=False).cluster
    assert cluster.num_cpus is None
    assert cpus.local_cores() == 2 and node_cpus(cluster) == 2 and local_init_kwargs(cluster)["num_cpus"] == 2


def test_quota_forms(host_of_64) -> None:
    assert cpus.cgroup_cpu_limit() is None and cpus.local_cores() == 64  # no cgroup files
    (host_of_64 / "cpu.max").write_text("max 100000\n")
    assert cpus.cgroup_cpu_limit() is None and cpus.local_cores() == 64  # v2 without a quota
    (host_of_64 / "cpu.max").write_text("150000 100000\n")
    assert cpus.local_cores() == 2  # 1.5 CPUs: rounded up
    (host_of_64 / "cpu.max").unlink()
    (host_of_64 / "cpu").mkdir()
    (host_of_64 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (host_of_64 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpus.local_cores() == 64  # v1 without a quota
    (host_of_64 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert cpus.local_cores() == 3  # v1 quota
    (host_of_64 / "cpu" / "cpu.cfs_quota_us").write_text("25000\n")
    assert cpus.local_cores() == 1  # a quarter CPU still runs one thread


def test_a_quota_on_the_processs_own_cgroup_below_the_top_counts(host_of_64) -> None:
    """Without a cgroup namespace of its own (systemd-run -p CPUQuota=, a batch job's scope, docker --cgroupns=host) the
    quota is on the process's cgroup, not at the top: only the top was read, so the run counted all 64 cores."""
    (host_of_64 / "self_cgroup").write_text("0::/system.slice/job42.scope\n")
    scope = host_of_64 / "system.slice" / "job42.scope"
    scope.mkdir(parents=True)
    (host_of_64 / "cpu.max").write_text("max 100000\n")
    (scope / "cpu.max").write_text("200000 100000\n")
    assert cpus.cgroup_cpu_limit() == 2 and cpus.local_cores() == 2
    (host_of_64 / "system.slice" / "cpu.max").write_text("100000 100000\n")  # a tighter parent: the smallest quota
    assert cpus.local_cores() == 1
    # cgroup v1: the CPU controller's line names the path below cpu/
    (host_of_64 / "self_cgroup").write_text("4:memory:/elsewhere\n3:cpu,cpuacct:/batch/job7\n")
    job = host_of_64 / "cpu" / "batch" / "job7"
    job.mkdir(parents=True)
    for directory, quota in ((host_of_64 / "cpu", -1), (host_of_64 / "cpu" / "batch", 800000), (job, 300000)):
        (directory / "cpu.cfs_period_us").write_text("100000\n")
        (directory / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    assert cpus.cgroup_cpu_limit() == 3
