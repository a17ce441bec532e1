"""``examples/cluster/slurm_grpo.sbatch`` run as Slurm would run it, on this machine (``make test-cluster``).

Stand-ins for ``srun`` and ``scontrol`` (``tests/cluster/standins/``) run each job step as a local process, so the
script starts a real Ray head and a second real Ray node here, submits the real training run with ``ray job
submit``, and gets SIGTERM as ``#SBATCH --signal=B:TERM@300`` delivers it (to the batch shell only). The run must
save and stop: the script's trap hands the signal to the job (``ray job stop``), the driver finishes its step, writes
the checkpoint and exits. 70-86 s on the 2-core machine; not part of ``make test`` (set ``NEMO_LIKE_CLUSTER_TESTS=1`` to run it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "cluster" / "slurm_grpo.sbatch"
STANDINS = Path(__file__).resolve().with_name("standins")

pytestmark = pytest.mark.skipif(
    os.environ.get("NEMO_LIKE_CLUSTER_TESTS") != "1", reason="a two-node Ray cluster under the Slurm script: make test-cluster"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logged_steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip() and "train/loss" in line]


def processes_with(marks: tuple[bytes, ...]) -> list[int]:
    """Live pids whose command line or environment holds one of ``marks`` (this test's Ray processes)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            seen = (proc / "cmdline").read_bytes() + b"\0" + (proc / "environ").read_bytes()
            if any(mark in seen for mark in marks):
                pids.append(int(proc.name))
    return pids


def test_the_slurm_script_starts_two_nodes_trains_and_saves_on_the_walltime_signal(tmp_path: Path) -> None:
    ray_temp = Path(tempfile.mkdtemp(prefix="nlsl", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    gcs_port, dashboard_port = free_port(), free_port()
    venv_bin = Path(sys.executable).parent
    env = {
        "PATH": f"{STANDINS}:{venv_bin}:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/tmp"),
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_CPUS_PER_TASK": "1",
        "RECIPE": str(ROOT / "examples/configs/grpo_tiny_cpu.yaml"),  # absolute (a relative one is read from REPO)
        "RUN_ROOT": "runs",  # relative: read from the submit dir (it had been passed on, and the driver ran in Ray's copy)
        "GCS_PORT": str(gcs_port),
        "DASHBOARD_PORT": str(dashboard_port),
        "RAY_AUTH_MODE": "disabled",
        # the job API on loopback only: the script's default, every interface, was an unauthenticated job API for the
        # test's 80 s (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which keeps Ray on loopback, also refuses a second node)
        "DASHBOARD_HOST": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "RAY_JOB_STOP_WAIT_TIME_S": "120",
        "STANDIN_RAY_TEMP_DIR": str(ray_temp),
    }
    overrides = [
        "grpo.max_num_steps=50",  # far more than the signal leaves it
        "grpo.val_period=0",
        "checkpointing.enabled=true",
        "checkpointing.save_period=1000",  # the only checkpoint is the one the signal asks for
        "policy.num_threads_per_worker=1",
    ]
    run_dir = tmp_path / "runs" / "4242"
    log_path = tmp_path / "slurm-4242.out"
    with log_path.open("w") as log:
        script = subprocess.Popen(
            ["bash", str(SCRIPT), *overrides], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while not logged_steps(run_dir / "logs" / "metrics.jsonl"):
            assert script.poll() is None and time.monotonic() < deadline, log_path.read_text()[-5000:]
            time.sleep(1.0)
        script.send_signal(signal.SIGTERM)  # --signal=B:TERM: the batch shell only, never the job's processes
        status = script.wait(timeout=240)
        out = log_path.read_text()
        assert "[slurm] SIGTERM: stopping nemo-like-4242" in out, out[-5000:]
        assert out.count(" node_") >= 2, out[-5000:]  # `ray status` listed both nodes before the job was submitted
        assert status == 143, out[-5000:]  # the job was STOPPED (saved), not SUCCEEDED: the script says so as the driver does
        assert (run_dir / "exit_status.4242").read_text() == "143\n"  # the driver's own status (Ray records none for a stop)
        steps = logged_steps(run_dir / "logs" / "metrics.jsonl")
        saved = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
        assert saved and saved[-1] == steps[-1], (saved, steps, out[-5000:])  # the step the signal interrupted, saved
        assert steps[-1] < 50 and "resume" in out.lower(), out[-5000:]
        print(f"\n[slurm] stopped after step {steps[-1]}, checkpoint step_{saved[-1]}, script exit {status}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)
        marks = (str(ray_temp).encode(), f"RAY_ADDRESS=127.0.0.1:{gcs_port}\0".encode(), f"--port={gcs_port}".encode())
        deadline = time.monotonic() + 20
        while (left := processes_with(marks)) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        shutil.rmtree(ray_temp, ignore_errors=True)
