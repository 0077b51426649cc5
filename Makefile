# `make run` / `make test` create .venv and install on first use (a stamp file makes re-runs fast).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deepinfer-installed
TINY_V41 := checkpoints/tiny-v41
# Extra index for the CPU torch wheel where it is not already on a local index, e.g.
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)

.PHONY: run test test-all install

install: $(STAMP)

$(STAMP): requirements.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(TORCH_INDEX_ARG) "$$(grep -E '^torch==' requirements.txt)"
	$(PY) -m pip install $(TORCH_INDEX_ARG) -r requirements.txt
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(TINY_V41)/config.json: | $(STAMP)
	$(PY) examples/tools/make_tiny_checkpoint.py --kind v41 --out $(TINY_V41)

run: $(STAMP) $(TINY_V41)/config.json
	$(PY) examples/offline_inference.py --model $(TINY_V41)

# The default tier: every test not marked slow (README "Tests" says what each command runs).
test: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow"

# Every tier, the slow tests and benchmarks included (CI runs this: .ci/run).
test-all: $(STAMP)
	$(PY) -m pytest -q tests -m "slow or not slow"
