"""Every rollout engine of a LoRA run samples from the learner's current adapter: async local workers (shared memory),
`vcpo serve` (weights directory) and Ray actors (object store), each sent the adapters' tensors alone.

How it is proven: with ``async.max_staleness=0`` every token a step trains on was sampled at the learner's current
version, so ``mismatch/logprob_abs_max`` (|learner log-prob - engine log-prob| over them, float32) is measured on fresh
tokens at every step. A delivery fault (the engines are told the new version but keep the first adapter) must push it
far above float32 noise from step 2 on (step 1 samples the initial adapter, which is then the current one)."""

from __future__ import annotations

import pytest

from vcpo.config import load_config

from conftest import ROOT, metrics

pytest.importorskip("peft")

FRESH_TOL = 1e-4  # float32 engine against learner: a few 1e-6 measured, 2.5e-5 the largest seen
STALE_MIN = 1e-3  # what a one-step-old adapter at lr 1e-2 gives (measured 1e-2 and above)

BACKENDS = {
    "async_local": [],
    "serve": ["rollout.engine=server", "rollout.server.kind=vcpo",
              "rollout.server.launch={num_servers: 1, startup_timeout_s: 120}"],
    "ray": ["async.backend=ray", "ray.address=local"],
}


def first_only(monkeypatch, owner, name: str) -> None:
    """Replace ``owner.name`` by a function that returns what its first call returned, ever after: the engines get
    the version number of each update with the first adapter's values (the fault to be caught)."""
    real, first = getattr(owner, name), []

    def stale(*args, **kwargs):
        out = real(*args, **kwargs)
        if not first:
            first.append({k: v.detach().clone() for k, v in out.items()} if isinstance(out, dict) else out)
        return first[0]

    monkeypatch.setattr(owner, name, stale)


def break_delivery(monkeypatch, backend: str) -> None:
    if backend == "ray":
        from vcpo.orchestration.ray.weights import WeightBoard

        first_only(monkeypatch, WeightBoard, "ref")  # the driver offers the actors the first version's object
    else:
        import vcpo.orchestration.async_local as async_local

        first_only(monkeypatch, async_local, "sync_state_dict")  # shared memory or the servers get the first adapter


def lora_run(tmp_path, tiny_overrides, backend: str) -> list[dict]:
    from vcpo.loop.trainer import train

    run_dir = tmp_path / backend
    config = load_config(ROOT / "configs" / "quickstart.yaml", [
        *tiny_overrides, "model.lora.rank=4", "trainer.lr=1e-2", "async.mode=async", "async.max_staleness=0",
        "trainer.max_steps=3", "trainer.eval_every=0", "trainer.checkpoint_every=0", f"run_dir={run_dir}",
        *BACKENDS[backend]])
    train(config)
    return metrics(run_dir)


@pytest.mark.parametrize("backend", list(BACKENDS))
# the broken delivery shows the check can fail: in the slow tier (`make test-slow`), not in `make test`
@pytest.mark.parametrize("broken", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["delivered", "stale"])
def test_every_engine_samples_from_the_current_adapter(tmp_path, tiny_overrides, monkeypatch, backend, broken):
    if backend == "ray":
        pytest.importorskip("ray")
    if broken:
        break_delivery(monkeypatch, backend)
    assert_adapter_fresh_or_caught(lora_run(tmp_path, tiny_overrides, backend), broken)


def assert_adapter_fresh_or_caught(lines: list[dict], broken: bool) -> None:
    """Three steps at k = 0: every step's tokens are fresh, so the engine/learner gap is float32 noise when the
    adapter is delivered. When the engine kept the first one, the gap is far above noise at every step after the
    learner's adapter first moved, and noise before: a step whose groups each got one reward throughout has zero
    advantages and moves nothing (with vLLM's own sampling, step 1 sometimes had no learning signal)."""
    assert [m["step"] for m in lines] == [1, 2, 3] and all(m["staleness/max"] == 0 for m in lines)
    gaps = [m["mismatch/logprob_abs_max"] for m in lines]  # every step: all its tokens are fresh
    if broken:
        moved = [any(m["reward/zero_var_group_frac"] < 1 for m in lines[:i]) for i in range(len(lines))]
        assert any(moved), f"no step before the last had a learning signal: nothing to catch ({lines})"
        for gap, adapter_moved in zip(gaps, moved, strict=True):
            assert gap > STALE_MIN if adapter_moved else gap < FRESH_TOL, (gaps, moved)
    else:
        assert max(gaps) < FRESH_TOL, gaps
