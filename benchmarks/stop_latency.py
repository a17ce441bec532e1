"""How long a run takes to stop: signals to a ``nemo-like train`` process of the tiny recipe, and a hang with the stall
watchdog set to abort. Each case is a run of its own, started fresh (its private Ray cluster included).

Usage: python benchmarks/stop_latency.py [--cases term,term-group,int-twice,stall-abort] [--after-step 3]

* ``term``: SIGTERM to the driver once ``--after-step`` steps are logged: seconds to exit (it finishes the step, saves,
  stops the actors and the private cluster), the exit status (143) and the checkpoint it names;
* ``term-group``: the same SIGTERM sent to the run's whole process group (what a terminal's or a scheduler's kill of
  the job does; the private cluster's processes get it too);
* ``int-twice``: SIGINT, then a second SIGINT 0.05 s later (inside the step the first lets finish): seconds from the
  second to exit (at once, no save; 130);
* ``stall-abort``: ``cluster.fault_injection.action=hang`` at step 2 with ``stall_timeout_s=4`` and ``on_stall=abort``:
  the silence the report names (``[stall] no progress for N s``), seconds from the report to exit, and the status (70).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STALL = ["cluster.fault_injection.action=hang", "cluster.fault_injection.step=2", "cluster.fault_tolerance.stall_timeout_s=4",
         "cluster.fault_tolerance.on_stall=abort"]  # fmt: skip


def start(log_dir: Path, overrides: list[str]) -> tuple[subprocess.Popen, list[tuple[float, str]]]:
    """A ``nemo-like train`` of the tiny recipe in its own process group, and the (time, line) of its stderr as they come."""
    cmd = [str(Path(sys.executable).with_name("nemo-like")), "train", "grpo.max_num_steps=200", "grpo.val_period=0",
           "checkpointing.enabled=true", f"checkpointing.checkpoint_dir={log_dir / 'ckpt'}", f"logger.log_dir={log_dir}",
           "logger.progress_bar=false", *overrides]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append((time.perf_counter(), line.rstrip()))

    threading.Thread(target=read, daemon=True).start()
    return proc, lines


def wait_for_step(proc: subprocess.Popen, log_dir: Path, step: int, timeout: float = 300.0) -> None:
    metrics, deadline = log_dir / "metrics.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists():
            steps = [json.loads(line).get("step", -1) for line in metrics.read_text().splitlines() if line.strip().endswith("}")]
            if steps and max(steps) >= step:
                return
        time.sleep(0.1)
    sys.exit(f"the run did not log step {step} (exit status {proc.poll()})")


def signalled(log_dir: Path, after_step: int, signals: list[int], group: bool = False) -> dict:
    proc, lines = start(log_dir, [])
    wait_for_step(proc, log_dir, after_step)
    sent = 0.0
    for i, sig in enumerate(signals):
        if i:
            time.sleep(0.05)
        sent = time.perf_counter()
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    status = proc.wait()
    exited = time.perf_counter()
    saved = next((m.group(1) for _, line in lines if (m := re.search(r"^\[stop\] stopped after step .*; checkpoint (\S+);", line))), None)
    return {"seconds to exit": exited - sent, "status": status, "checkpoint": Path(saved).name if saved else None}


def stall_abort(log_dir: Path) -> dict:
    proc, lines = start(log_dir, STALL)
    status = proc.wait(timeout=300)
    exited = time.perf_counter()
    report = next(((t, line) for t, line in lines if line.startswith("[stall] no progress for")), None)
    if report is None:
        return {"status": status, "report": None}
    silence = re.search(r"no progress for ([\d.]+)s", report[1])
    return {
        "silence the report names (s)": float(silence.group(1)) if silence else None,
        "report to exit (s)": exited - report[0],
        "status": status,
    }


CASES = {
    "term": lambda d, n: signalled(d, n, [signal.SIGTERM]),
    "term-group": lambda d, n: signalled(d, n, [signal.SIGTERM], group=True),
    "int-twice": lambda d, n: signalled(d, n, [signal.SIGINT, signal.SIGINT]),
    "stall-abort": lambda d, n: stall_abort(d),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {list(CASES)}")
    p.add_argument("--after-step", type=int, default=3, help="signal once this many steps are logged")
    args = p.parse_args()
    names = args.cases.split(",")
    if unknown := [n for n in names if n not in CASES]:
        p.error(f"unknown cases {unknown}; choose from {list(CASES)}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            result = CASES[name](Path(tmp) / name, args.after_step)
            shown = ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())
            print(f"{name}: {shown}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
