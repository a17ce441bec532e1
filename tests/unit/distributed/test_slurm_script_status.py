"""``examples/cluster/slurm_grpo.sbatch``'s own logic, in seconds: stand-in ``srun``, ``scontrol``, ``ray`` and ``python``
commands (shell scripts written here) play the cluster, so the script's overrides, its exit status and its SIGTERM trap
run as Slurm runs them. The real two-node run is ``tests/cluster/test_slurm_launcher.py`` (``make test-cluster``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "examples" / "cluster" / "slurm_grpo.sbatch"

STANDINS = {
    "scontrol": "echo node1\n",
    # `hostname --ip-address` answers; every other step (`ray start --block`) lives a while, as Slurm's would
    "srun": 'for a in "$@"; do [[ $a == hostname ]] && { echo 127.0.0.1; exit 0; }; done\nexec sleep 5 >/dev/null 2>&1\n',
    # `ray job submit` records its arguments, runs a while (SUBMIT_SECONDS) and writes the driver's status file with
    # DRIVER_STATUS; `ray job stop` fails (STOP_FAILS) like a job API that does not answer
    "ray": (
        'case "$1 $2" in\n'
        '  "status "*) echo "Active:"; echo " 1 node_aaaa";;\n'
        '  "job submit") printf "%s\\n" "$@" > "$RECORD"; sleep "${SUBMIT_SECONDS:-0}"\n'
        '     for a in "$@"; do [[ $a == NEMO_LIKE_EXIT_STATUS_FILE=* && -n $DRIVER_STATUS ]] && echo "$DRIVER_STATUS" > "${a#*=}"; done;;\n'
        '  "job stop") echo stop >> "$RECORD.stop"; exit "${STOP_FAILS:-0}";;\n'
        "esac\n"
    ),
    # the job status query: JOB_INFO (e.g. "FAILED 2") or, unset, a job API that cannot be reached
    "python": '[[ -n ${JOB_INFO:-} ]] && { echo "$JOB_INFO"; exit 0; }; echo "ConnectionError" >&2; exit 1\n',
}


def run_script(tmp_path: Path, env: dict[str, str], term_after: float | None = None) -> tuple[int, str, list[str]]:
    """Run the script with the stand-ins first on PATH; returns (exit status, output, the `ray job submit` arguments)."""
    bin_dir, repo = tmp_path / "bin", tmp_path / "repo"
    bin_dir.mkdir()
    for name, body in STANDINS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    (repo / ".venv" / "bin").mkdir(parents=True)
    (repo / ".venv" / "bin" / "activate").write_text("")
    (repo / "examples" / "configs").mkdir(parents=True)
    (repo / "examples" / "configs" / "recipe.yaml").write_text("grpo: {max_num_steps: 2}\n")
    (repo / "examples" / "prompts").mkdir()
    full_env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "REPO": str(repo),
        "RECIPE": "examples/configs/recipe.yaml",
        "RUN_ROOT": str(tmp_path / "runs"),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node1",
        "RAY_AUTH_MODE": "disabled",
        "RECORD": str(tmp_path / "submit_args"),
        **env,
    }
    proc = subprocess.Popen(["bash", str(SCRIPT)], env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if term_after is not None:
        deadline = time.monotonic() + 20
        while not (tmp_path / "submit_args").exists() and time.monotonic() < deadline:  # the job is submitted
            time.sleep(0.05)
        time.sleep(term_after)
        proc.send_signal(signal.SIGTERM)  # as `#SBATCH --signal=B:TERM@300` delivers it: to the batch shell
    output, _ = proc.communicate(timeout=60)
    submitted = (tmp_path / "submit_args").read_text().splitlines() if (tmp_path / "submit_args").exists() else []
    return proc.returncode, output, submitted


def test_the_drivers_status_file_decides_the_exit_status_when_the_job_api_does_not_answer(tmp_path: Path) -> None:
    """The final job-status query failing (the `read` of its empty output failed under `set -e`) ended the script with 1
    before the status file was read: a saved signal stop (143) looked like a crash to a requeue rule."""
    status, output, submitted = run_script(tmp_path, {"DRIVER_STATUS": "143", "SLURM_GPUS_PER_NODE": "h100:8"})
    assert status == 143 and "[slurm] exit status 143" in output, output
    # Every recipe saves on the signal: checkpointing is switched on (a recipe without it stopped with 143, nothing saved)
    assert "checkpointing.enabled=true" in submitted and f"checkpointing.checkpoint_dir={tmp_path}/runs/7/checkpoints" in submitted
    # The cluster the recipe plans for is the allocation's: its node count, and its GPUs per node without the type
    assert "cluster.num_nodes=1" in submitted and "cluster.gpus_per_node=8" in submitted, submitted


@pytest.mark.parametrize(("job_info", "expected"), [("FAILED 2", 2), ("STOPPED ", 137)], ids=["failed", "stopped-unsaved"])
def test_the_job_apis_status_is_the_exit_status_without_a_status_file(tmp_path: Path, job_info: str, expected: int) -> None:
    """Without the driver's status file the job API decides: a failed driver's own status, and 137 for a job that
    `ray job stop` stopped with no status written (its driver killed before it saved: nothing to resume from)."""
    status, output, _ = run_script(tmp_path, {"DRIVER_STATUS": "", "JOB_INFO": job_info})
    assert status == expected and f"[slurm] exit status {expected}" in output, output


def test_a_failed_ray_job_stop_in_the_sigterm_trap_still_waits_for_the_driver(tmp_path: Path) -> None:
    """Under `set -e` a failing `ray job stop` in the trap ended the script at once: the driver's save and its status
    were never waited for. The driver here fails its save (status 1, written 2 s after the job started): a script that
    stopped waiting at the trap would exit with the signal's 143, which a requeue rule reads as "saved"."""
    env = {"DRIVER_STATUS": "1", "SUBMIT_SECONDS": "2", "STOP_FAILS": "1"}
    status, output, _ = run_script(tmp_path, env, term_after=0.5)
    assert (tmp_path / "submit_args.stop").exists(), output  # the trap ran
    assert "[slurm] warning: ray job stop failed" in output and status == 1 and "[slurm] exit status 1" in output, output
