# `make run` / `make test` create .venv and install on first use (a stamp file makes re-runs fast).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deepinfer-installed
TINY_V41 := checkpoints/tiny-v41
# The trained V4.1 checkpoint: the committed compact artifact (examples/train_tiny.py wrote it),
# expanded to the full real-layout checkpoint (examples/tools/trained_artifact.py, a few seconds).
TRAINED_V41 := checkpoints/trained-v41
TRAINED_V41_ARTIFACT := examples/artifacts/trained-v41.safetensors
# Extra index for the CPU torch wheel where it is not already on a local index, e.g.
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)

.PHONY: run tiny test test-all install

install: $(STAMP)

$(STAMP): requirements.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(TORCH_INDEX_ARG) "$$(grep -E '^torch==' requirements.txt)"
	$(PY) -m pip install $(TORCH_INDEX_ARG) -r requirements.txt
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(TINY_V41)/config.json: | $(STAMP)
	$(PY) examples/tools/make_tiny_checkpoint.py --kind v41 --out $(TINY_V41)

# a random tiny V4.1 checkpoint (weights that know nothing; the test fixtures' kind)
tiny: $(STAMP) $(TINY_V41)/config.json

$(TRAINED_V41)/config.json: $(TRAINED_V41_ARTIFACT) | $(STAMP)
	$(PY) examples/tools/trained_artifact.py expand $(TRAINED_V41_ARTIFACT) $(TRAINED_V41)

# Held-out prompts of each kind of docs/tiny_language.md, the model's answers, how many were right:
# the trained checkpoint when its artifact is committed, else the random tiny one (which answers none).
ifneq ($(wildcard $(TRAINED_V41_ARTIFACT)),)
RUN_MODEL := $(TRAINED_V41)
else
RUN_MODEL := $(TINY_V41)
endif

run: $(STAMP) $(RUN_MODEL)/config.json
	$(PY) examples/offline_inference.py --model $(RUN_MODEL)

# The default tier: every test not marked slow (README "Tests" says what each command runs).
test: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow"

# Every tier, the slow tests and benchmarks included (CI runs this: .ci/run).
test-all: $(STAMP)
	$(PY) -m pytest -q tests -m "slow or not slow"
