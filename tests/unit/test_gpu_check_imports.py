"""The GPU checks (tests/gpu) start on a machine with only torch, transformers and small pure-Python packages.

Tier A must import neither Ray, nor vLLM, nor Hydra: every module its code imports (at module level or inside a check,
read from the source) is imported in a fresh interpreter, which must end without those in ``sys.modules``. The
runner and the other tiers' modules must import with the standard library alone, so that ``--tier B`` on such a
machine reports NOT RUN instead of crashing. And without a CUDA device the runner says so, check by check.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "tests" / "gpu"
TIER_A_SOURCES = ("run_gpu_check.py", "checklib.py", "models.py", "tier_a.py")
FORBIDDEN = ("ray", "vllm", "hydra")


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, at any depth of its code."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def run_python(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(GPU), str(REPO)])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tier_a_imports_pull_in_neither_ray_nor_vllm_nor_hydra():
    modules = sorted(set().union(*(imported_modules(GPU / name) for name in TIER_A_SOURCES)))
    code = f"""
import importlib, json, sys
import tier_a
declared = sorted({{m for check in tier_a.CHECKS for m in check.imports}})
failed = {{}}
for name in {modules!r} + declared:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = repr(exc)
print(json.dumps({{"loaded": sorted(m for m in {FORBIDDEN!r} if m in sys.modules), "failed": failed, "declared": declared}}))
"""
    result = run_python(code)
    assert result["failed"] == {}
    assert "nemo_like.models.policy.worker" in result["declared"]
    assert result["loaded"] == [], f"tier A's imports load {result['loaded']}"


def test_the_runner_and_every_tier_module_import_with_the_standard_library_only():
    code = """
import json, sys
before = set(sys.modules)
import run_gpu_check, tier_a, tier_b, tier_multi
third_party = sorted({m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)
                     - {'run_gpu_check', 'checklib', 'models', 'tier_a', 'tier_b', 'tier_multi'})
print(json.dumps({"third_party": third_party, "checks": [c.id for t in (tier_a, tier_b, tier_multi) for c in t.CHECKS]}))
"""
    result = run_python(code)
    assert result["third_party"] == []
    assert result["checks"] == [*(f"A{i}" for i in range(5)), *(f"B{i}" for i in range(1, 10)), "M1", "M2", "M3"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is here: the checks would run")
def test_without_a_cuda_device_every_check_is_not_run_and_the_exit_status_says_so(tmp_path):
    command = [sys.executable, str(GPU / "run_gpu_check.py"), "--tier", "A", "--json", str(tmp_path / "a.json")]
    strict = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert strict.returncode == 3, strict.stdout + strict.stderr
    lines = [line for line in strict.stdout.splitlines() if not line.startswith("#")]
    assert len(lines) == 5 and all(line.startswith("NOT RUN") and "no CUDA device" in line for line in lines), strict.stdout
    summary = json.loads((tmp_path / "a.json").read_text())
    assert {c["status"] for c in summary["checks"]} == {"NOT RUN"} and summary["exit_status"] == 3
    assert all(c["imports"] == "ok" for c in summary["checks"]), summary["checks"]
    # With --allow-no-gpu (make test-gpu) the same run exits 0: checklib.exit_status, test_verdicts_and_exit_statuses.


def test_verdicts_and_exit_statuses():
    code = """
import json
import checklib
fig = checklib.Figures()
fig["a"], fig["b"] = 0.5, float("nan")
held = [fig.expect("a", "<=", 1.0), fig.expect("a", ">=", 1.0), fig.expect("b", "<=", 1.0), fig.expect("missing", "==", 1)]
r = lambda status: checklib.Result("X", "x", "A", status)
gpu, none = (True, 1, ""), (False, 0, checklib.NO_CUDA)
unusable = checklib.cuda_state(device_glob="/")  # as if a GPU's device node existed
statuses = [
    checklib.exit_status([r("PASS"), r("SKIP")], gpu, False),
    checklib.exit_status([r("PASS"), r("FAIL")], gpu, False),
    checklib.exit_status([r("PASS"), r("NOT RUN")], gpu, False),
    checklib.exit_status([r("NOT RUN")], none, False),
    checklib.exit_status([r("NOT RUN")], none, True),
    checklib.exit_status([r("NOT RUN")], unusable, True),  # --allow-no-gpu does not cover a GPU torch cannot use
]
try:
    import no_such_module_for_the_gpu_check  # noqa
except ImportError as exc:
    chain = checklib.import_chain(exc)
print(json.dumps({"held": held, "failures": len(fig.failures), "statuses": statuses, "chain": chain, "unusable": unusable[2]}))
"""
    result = run_python(code)
    assert result["held"] == [True, False, False, False] and result["failures"] == 3
    assert result["statuses"] == [0, 1, 4, 3, 0, 3]
    assert result["unusable"].startswith("/ exists but torch") and "sees no CUDA device" in result["unusable"]
    assert result["chain"] == ["no_such_module_for_the_gpu_check"]


def test_a_mistyped_only_id_is_refused_instead_of_deselecting_every_check():
    """``--only=a2`` (or an id of no tier) deselected every check, and the run said "ok" (exit 0)."""
    code = """
import json, run_gpu_check
out = {}
for argv in (["--tier", "A", "--only", "a2"], ["--tier", "multi", "--only", "A2"], ["--tier", "all", "--only", "A2,B4"],
             ["--tier", "A", "--only", "B1"]):
    try:
        out[" ".join(argv)] = run_gpu_check.parse_args(argv).only
    except SystemExit as exc:
        out[" ".join(argv)] = exc.code
print(json.dumps(out))
"""
    assert run_python(code) == {
        "--tier A --only a2": 2, "--tier multi --only A2": 2, "--tier all --only A2,B4": "A2,B4", "--tier A --only B1": 2,
    }  # fmt: skip


def test_a_tier_with_no_selected_check_is_listed_as_skipped_and_the_summary_keeps_the_versions(tmp_path):
    """``--tier all --only B4``: tier A had not run at all (its checks missing from the lines and the counts), and the
    summary took the versions and the GPU from tier A alone (null)."""
    command = [sys.executable, str(GPU / "run_gpu_check.py"), "--tier", "all", "--only", "B4", "--json", str(tmp_path / "all.json")]
    run = subprocess.run([*command, "--allow-no-gpu"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads((tmp_path / "all.json").read_text())
    statuses = {c["id"]: c["status"] for c in summary["checks"]}
    assert statuses["B4"] == "NOT RUN" and {i for i, s in statuses.items() if s == "SKIP"} == set(statuses) - {"B4"}
    assert {"A0", "A4", "B1", "B9"} <= set(statuses) and summary["counts"]["SKIP"] == len(statuses) - 1
    assert summary["versions"]["torch"].startswith("2.") and "SKIP     A2" in run.stdout
