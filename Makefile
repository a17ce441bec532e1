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

.PHONY: setup demo test test-fast clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[test,logging]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/nemo-like train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest tests -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest tests -q -m "not slow" $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
