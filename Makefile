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

.PHONY: run test install

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

test: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow"
