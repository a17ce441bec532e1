"""``make test-gpu`` under pytest: each tier of ``run_gpu_check.py`` in a subprocess; skipped without a CUDA device.

Nothing heavy at module level (torch only, for the skip condition): on a machine without a GPU collection costs nothing.
See docs/guides/gpu.md for what each check does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("run_gpu_check.py")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: run `make test-gpu` on a GPU machine"),
]


def run_tier(tier: str, tmp_path: Path) -> None:
    out = tmp_path / f"gpu_check_{tier}.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tier", tier, "--json", str(out)], capture_output=True, text=True)
    print(proc.stdout)
    print(proc.stderr[-20000:], file=sys.stderr)
    assert out.exists(), f"no summary (exit {proc.returncode})"
    checks = json.loads(out.read_text())["checks"]
    not_run = [c for c in checks if c["status"] == "NOT RUN"]
    failed = [f"{c['id']} {c['name']}: {c['reason']}" for c in checks if c["status"] == "FAIL"]
    assert not failed, "\n".join(failed)
    if not_run and len(not_run) == len(checks):
        pytest.skip(f"tier {tier} did not run here: {not_run[0]['reason']}")
    assert not not_run, "\n".join(f"{c['id']} {c['name']}: NOT RUN: {c['reason']}" for c in not_run)
    assert proc.returncode == 0


def test_tiers_a_then_b(tmp_path):
    """One test: ``--tier all`` runs A, then B, each in its own process. Two tests could run at once on two pytest
    workers (``make test`` runs ``-n 2``), and tier B's memory checks read the whole device (a training tier A beside
    it would move them)."""
    run_tier("all", tmp_path)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA devices (make test-gpu-multi)")
def test_multi_gpu(tmp_path):
    run_tier("multi", tmp_path)
