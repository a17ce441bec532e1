"""``ray job submit`` against a real local head: a 2-step tiny run succeeds, an over-asking one fails fast.

Everything is driven through the ``ray`` CLI in subprocesses (plus the jobs REST API for status
polling); this pytest process never calls ``ray.init``, so the session's private cluster
(``ray_cluster`` in conftest) is untouched. The head gets its own ports and ``--temp-dir`` and runs
as ``ray start --head --block`` in its own session: it is stopped by signalling that process, never
with ``ray stop``, which kills every Ray process on the machine (other tests' and other users'
clusters included).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
from functional.helpers import TINY_OVERRIDES, TINY_RECIPE, read_metrics

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# What `ray job submit` prints when the head is up but cannot take a job yet (retried, see LocalHead.submit).
HEAD_NOT_READY = ("No available agent", "Remote end closed connection", "Connection aborted", "Connection refused")


@dataclass
class LocalHead:
    """A ``ray start --head --block`` process bound to loopback, with its ports and temp dir."""

    process: subprocess.Popen
    temp_dir: Path
    gcs_port: int
    dashboard_url: str
    env: dict[str, str]
    start_s: float = 0.0
    jobs: list[str] = field(default_factory=list)

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run ``ray <args>`` against this head's jobs API.

        Output goes to files, not pipes: once seen in CI, ``ray job submit`` exited 0 with its output
        complete while some process it left behind still held the pipes open, so reading them to
        EOF hung past the timeout. Waiting on the CLI process alone cannot be held up that way.
        """
        with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
            returncode = subprocess.run([RAY, *args], env=self.env, stdout=stdout, stderr=stderr, timeout=timeout).returncode
            stdout.seek(0)
            stderr.seek(0)
            return subprocess.CompletedProcess([RAY, *args], returncode, stdout.read(), stderr.read())

    def submit(
        self, submission_id: str, working_dir: Path, entrypoint: list[str], retry_s: float = 90, refused_restart_s: float = 20
    ) -> None:
        """``ray job submit --no-wait`` with a working dir; the job's id is ours, for polling.

        A head on a loaded machine answers its jobs API before it can take jobs: seen in CI, a submission failed
        with Ray's "No available agent to submit job, please try again later" and, in another run, with the
        dashboard closing the connection during the working-dir upload. Those connection-level answers are retried
        for up to ``retry_s`` (a job that the head did create is not submitted twice); any other failure fails the
        test at once. Also seen in CI: a head whose dashboard had answered at start refused every connection from the
        first submission on, for the whole retry window. A dashboard that refuses connections for ``refused_restart_s``
        (or a head process that exited) is replaced once by a fresh head (:meth:`restart`)."""
        deadline = time.monotonic() + retry_s
        refused_since: float | None = None
        restarted = False
        while True:
            out = self.cli(
                "job", "submit", "--address", self.dashboard_url, "--submission-id", submission_id,
                "--working-dir", str(working_dir), "--no-wait", "--", *entrypoint,
            )  # fmt: skip
            if out.returncode == 0 or self.exists(submission_id):
                break
            text = out.stdout + out.stderr
            refused = "Connection refused" in text
            refused_since = (refused_since or time.monotonic()) if refused else None
            head_gone = self.process.poll() is not None
            if not restarted and (head_gone or (refused_since is not None and time.monotonic() - refused_since > refused_restart_s)):
                print(f"[ray_head] dashboard unreachable (head exited: {head_gone}); starting a fresh head\n{self.log_tail()}")
                self.restart()
                restarted, refused_since, deadline = True, None, time.monotonic() + retry_s
                continue
            transient = any(mark in text for mark in HEAD_NOT_READY)
            assert transient and time.monotonic() < deadline, f"{text}\n--- head log ---\n{self.log_tail()}"
            time.sleep(1.0)
        self.jobs.append(submission_id)

    def restart(self) -> None:
        """Stop this head and everything it started, and become a fresh one (new ports, new temp dir)."""
        stop_head(self)
        fresh = start_head()
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the head's own log (``ray start --block`` output)."""
        try:
            return (self.temp_dir / "head.log").read_text()[-chars:]
        except OSError:
            return "(no head log)"

    def exists(self, submission_id: str) -> bool:
        """Whether the head knows a job of this id."""
        try:
            self.status(submission_id)
            return True
        except (OSError, KeyError):  # urllib's HTTPError (404) and connection errors are OSErrors
            return False

    def status(self, submission_id: str) -> str:
        return self._get(f"/api/jobs/{submission_id}")["status"]

    def wait(self, submission_id: str, timeout_s: float) -> tuple[str, float]:
        """Poll until the job is terminal; returns its status and the seconds waited."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            status = self.status(submission_id)
            if status in TERMINAL:
                return status, time.monotonic() - start
            time.sleep(0.5)
        return self.status(submission_id), time.monotonic() - start

    def logs(self, submission_id: str) -> str:
        out = self.cli("job", "logs", submission_id, "--address", self.dashboard_url)
        return out.stdout + out.stderr

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(self.dashboard_url + path, timeout=10) as response:
            return json.loads(response.read())

    def _post(self, path: str) -> None:
        request = urllib.request.Request(self.dashboard_url + path, method="POST")
        urllib.request.urlopen(request, timeout=10).close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def head_env() -> dict[str, str]:
    """Loopback-only, no auth (the CLI clients need it too), offline, and a quick SIGTERM shutdown."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        HF_HUB_OFFLINE="1",
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    return env


def start_head(timeout_s: float = 90) -> LocalHead:
    """Start the head and wait until its jobs API answers."""
    temp_dir = Path(tempfile.mkdtemp(prefix="nlrj", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    gcs_port, dashboard_port = free_port(), free_port()
    env = head_env()
    cmd = [
        RAY, "start", "--head", "--block", "--num-cpus=2", "--object-store-memory=268435456",
        f"--port={gcs_port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
        f"--temp-dir={temp_dir}",
    ]  # fmt: skip
    start = time.monotonic()
    log = open(temp_dir / "head.log", "w")
    process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    head = LocalHead(process, temp_dir, gcs_port, f"http://127.0.0.1:{dashboard_port}", env)
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            break
        try:
            head._get("/api/jobs/")
            head.start_s = time.monotonic() - start
            return head
        except OSError:
            time.sleep(0.25)
    stop_head(head)
    raise RuntimeError(f"Ray head did not come up in {timeout_s}s:\n{(temp_dir / 'head.log').read_text()[-3000:]}")


def stop_head(head: LocalHead) -> None:
    """Stop running jobs, SIGTERM the ``--block`` process (it stops what it started), kill leftovers by pid."""
    for submission_id in head.jobs:
        try:
            if head.status(submission_id) not in TERMINAL:
                head._post(f"/api/jobs/{submission_id}/stop")
        except OSError:
            pass
    if head.process.poll() is None:
        head.process.send_signal(signal.SIGTERM)
        try:
            head.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.process.kill()
            head.process.wait(timeout=10)
    deadline = time.monotonic() + 10
    while (leftovers := processes_of(head)) and time.monotonic() < deadline:
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    shutil.rmtree(head.temp_dir, ignore_errors=True)


def processes_of(head: LocalHead) -> list[int]:
    """Live pids of this head only: its temp dir on the command line, or its GCS as RAY_ADDRESS (job drivers)."""
    marks = (str(head.temp_dir).encode(), f"RAY_ADDRESS=127.0.0.1:{head.gcs_port}\0".encode())
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # already dead, waiting to be reaped
            seen = (proc / "cmdline").read_bytes() + b"\0" + (proc / "environ").read_bytes() + b"\0"
        except OSError:
            continue
        if any(mark in seen for mark in marks):
            pids.append(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def ray_head() -> Iterator[LocalHead]:
    head = start_head()
    try:
        yield head
    finally:
        stop_head(head)
    assert not processes_of(head), "processes of the test head survived its stop"


def test_job_submit_trains_and_an_over_asking_job_fails_fast(ray_head: LocalHead, tmp_path: Path) -> None:
    working_dir = tmp_path / "job"  # uploaded by --working-dir: keep it tiny
    working_dir.mkdir()
    shutil.copy(TINY_RECIPE, working_dir / TINY_RECIPE.name)
    log_dir = tmp_path / "logs"
    train = [
        sys.executable,
        "-m",
        "nemo_like.cli",
        "train",
        "--config",
        TINY_RECIPE.name,
        *TINY_OVERRIDES,  # the CPU default engine: inline in the policy worker, no engine actor to start
        # One thread per actor: this test's head inherits the xdist worker's nice 19, where a 2-thread actor stalls at
        # every OpenMP barrier whose partner thread lost its core to the other worker's cluster (conftest.py).
        "policy.num_threads_per_worker=1",
    ]  # config: relative to the working dir

    start = time.monotonic()
    ray_head.submit("nl-tiny", working_dir, [*train, f"logger.log_dir={log_dir}"])
    submit_s = time.monotonic() - start
    start_big = time.monotonic()
    ray_head.submit("nl-too-many-gpus", working_dir, [*train, "cluster.gpus_per_node=8"])  # the recipe's relative log_dir

    # Fails fast = at the capacity check, before any actor starts (no wall-clock bound: on a loaded machine the job's
    # runtime env and imports alone took over a minute in CI).
    big_status, _ = ray_head.wait("nl-too-many-gpus", timeout_s=240)
    big_s = time.monotonic() - start_big
    big_logs = ray_head.logs("nl-too-many-gpus")
    assert big_status == "FAILED", big_logs[-3000:]
    assert "short by GPU 8" in big_logs, big_logs[-3000:]
    assert "actors ready" not in big_logs, big_logs[-3000:]
    assert "The cluster has in total: CPU 2, GPU 0." in big_logs, big_logs[-3000:]
    assert "warning: logger.log_dir='logs/grpo_tiny_cpu' is relative: in this Ray job it is " in big_logs, big_logs[-3000:]
    assert "_ray_pkg_" in big_logs.split("logger.log_dir=")[1].split("\n")[0], big_logs[-3000:]  # Ray's unpacked copy

    status, _ = ray_head.wait("nl-tiny", timeout_s=240)
    tiny_s = time.monotonic() - start
    assert status == "SUCCEEDED", ray_head.logs("nl-tiny")[-5000:]
    records = read_metrics(log_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "validation/accuracy" in records[0] and "train/loss" in records[1] and "train/loss" in records[2]
    print(
        f"\n[ray job submit] head up {ray_head.start_s:.1f}s; submit call {submit_s:.1f}s; "
        f"tiny job SUCCEEDED {tiny_s:.1f}s after submit; over-asking job FAILED {big_s:.1f}s after submit"
    )
