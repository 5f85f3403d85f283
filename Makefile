# The two commands of the README: `make test` (lint + test suite) and `make demo` (the main job).
# Each creates .venv on a fresh machine and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint unit venv clean demo

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[dev,ray]"  # ray: the Ray backend's tests
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

unit: $(STAMP)
	$(BIN)/pytest

test: lint unit

# The main job: warm-start the embedded model by SFT (cached in .cache/vcpo), train it with
# asynchronous VCPO, print held-out accuracy before and after, and write the plots.
demo: $(STAMP)
	rm -rf runs/quickstart  # each demo is a fresh run; the SFT warm start stays cached
	HF_HUB_OFFLINE=1 $(BIN)/vcpo train -c configs/quickstart.yaml run_dir=runs/quickstart
	$(BIN)/vcpo plot runs/quickstart

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
