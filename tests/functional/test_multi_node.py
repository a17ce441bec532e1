"""Two Ray nodes on this machine: the policy's FSDP2 ranks land on different nodes and train together."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("two_node_training.py")


def test_policy_ranks_on_two_nodes_train_two_steps(tmp_path):
    # A subprocess: its two-node cluster must not meet the session's `ray_cluster` (one Ray per process).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "STRICT_SPREAD"], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cluster_nodes"] == 2 and result["laptop_recipe_nodes"] == 2  # the run's plan reads the nodes Ray has
    assert len(set(result["nodes"])) == 2  # STRICT_SPREAD: one policy rank per node
    assert len(result["grad_norms"]) == 2 and all(math.isfinite(g) and g > 0 for g in result["grad_norms"])
    assert result["before"][0] == result["before"][1] and result["after"][0] == result["after"][1]
    assert result["after"][0] != result["before"][0]  # the two steps changed the weights
