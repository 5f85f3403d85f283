"""Rollouts from two live `vcpo serve` processes (started once for the module): log-probs through HTTP that the
learner reproduces, an update in the middle of a generation (abort and continue, one version per token), sync and
async runs from the command line, a server killed mid-run (the other carries on), every server down (one error)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from vcpo.models.loading import load_policy
from vcpo.rollout.server import ServerRolloutEngine, ServerWeightPublisher
from vcpo.rollout.server_pool import ServerError, ServerPool
from vcpo.types import SamplingParams

from conftest import ROOT, metrics, save_tiny_policy, serving

PROMPTS = [[5, 6, 7], [8, 9], [40, 41, 42, 43], [60]] * 2
LONG_BATCH = PROMPTS * 3  # 12 rows a server: each decoding step takes longer, the update has time to land
REQUIRED_KEYS = {"step", "reward/mean", "ess/ratio", "grad_norm", "lr", "staleness/max", "staleness/mean",
                 "time/step_s"}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="module")
def servers(policy):
    with serving(policy, count=2) as procs:
        yield procs


def engine_for(urls, tmp_path, retries: int = 1) -> ServerRolloutEngine:
    pool = ServerPool(urls, "vcpo", retries=retries, retry_backoff_s=0.05, request_timeout_s=60)
    return ServerRolloutEngine(pool, ServerWeightPublisher(pool, tmp_path / "weights"), version=0)


def recompute(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(tokens)]


def perturbed(model, seed: int):
    """A copy of ``model`` with noise on every parameter (tied embeddings stay tied)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return other


def test_generations_through_http_match_the_learners_logprobs_on_both_servers(servers, policy, tmp_path):
    model, _ = load_policy(policy)
    engine = engine_for([u for u, _ in servers], tmp_path)
    engine.load_weights(model.state_dict(), 0)  # both servers back to the weights recomputed here
    gens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    gap = max(abs(a - b) for prompt, g in zip(PROMPTS, gens, strict=True)
              for a, b in zip(g.behavior_logprobs, recompute(model, prompt, g.response_ids), strict=True))
    assert gap <= 1e-5  # float32 end to end, through JSON
    assert all(g.versions == [0] * len(g.response_ids) and len(g.response_ids) <= 12 for g in gens)
    assert any(len(g.response_ids) == 12 and not g.finished for g in gens)


def test_an_update_mid_generation_continues_under_the_new_version_token_by_token(servers, policy, tmp_path):
    """Each try: a batch starts under version v, the update to v + 1 lands while it runs; every token is tagged
    with, and carries the log-prob of, the weights that sampled it. Whether the update beats a batch to its end is
    a race (a slow machine writes the weights slowly, the tiny model's rows can end early at EOS), so the tries go
    on until one response spans both versions; with updates that wait for the batch to finish, none ever does."""
    model, _ = load_policy(policy)
    new_model = perturbed(model, seed=1)
    old, new = model.state_dict(), new_model.state_dict()
    engine = engine_for([u for u, _ in servers], tmp_path)
    sampling = SamplingParams(max_new_tokens=240)
    spanning = 0
    for attempt in range(6):
        before = 2 * attempt
        engine.load_weights(old, before)
        result: dict = {}
        worker = threading.Thread(target=lambda out=result: out.update(gens=engine.generate(LONG_BATCH, sampling)))
        worker.start()
        while not any(httpx.get(u + "/health").json()["generating"] for u, _ in servers) and worker.is_alive():
            time.sleep(0.002)
        engine.load_weights(new, before + 1)  # pause (abort) -> update -> resume on both, while a batch runs
        worker.join(timeout=120)
        for prompt, g in zip(LONG_BATCH, result["gens"], strict=True):
            cut = g.versions.count(before)
            assert g.versions == [before] * cut + [before + 1] * (len(g.versions) - cut)  # in order, one per token
            spanning += 0 < cut < len(g.versions)
            lp_old = recompute(model, prompt, g.response_ids)
            lp_new = recompute(new_model, prompt, g.response_ids)
            expected = lp_old[:cut] + lp_new[cut:]  # each token's log-prob under the weights that sampled it
            assert max(abs(a - b) for a, b in zip(g.behavior_logprobs, expected, strict=True)) <= 1e-5
        if spanning:
            break
    assert spanning > 0, "in 6 tries no response had tokens from both versions"
    engine.load_weights(old, 0)


def run_cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "vcpo.cli", *args], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def tiny_run(policy, servers, run_dir, mode: str, steps: int) -> list[str]:
    urls = ",".join(u for u, _ in servers)
    return ["train", "-c", "configs/quickstart.yaml", f"run_dir={run_dir}", f"model.path={policy}",
            "rollout.engine=server", f"rollout.server.urls=[{urls}]", "rollout.server.retries=1",
            "rollout.server.retry_backoff_s=0.05", f"async.mode={mode}", f"trainer.max_steps={steps}",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=12", "task.eval_size=8",
            "trainer.eval_every=0", "trainer.checkpoint_every=0", "logging.progress=false", "trainer.lr=1e-3"]


@pytest.mark.parametrize(("mode", "lags"), [("sync", [0, 0, 0]), ("lagged", [0, 1, 1])])
def test_sync_and_lagged_runs_through_servers(servers, policy, tmp_path, mode, lags):
    proc = run_cli(*tiny_run(policy, servers, tmp_path / mode, mode, steps=3), "async.max_staleness=1")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    lines = metrics(tmp_path / mode)
    assert [m["step"] for m in lines] == [1, 2, 3] and [m["staleness/max"] for m in lines] == lags
    for m in lines:
        assert REQUIRED_KEYS <= m.keys()
    # Tokens sampled at the learner's weights (every step in sync, step 1 in lagged), recomputed through HTTP:
    mismatches = [m["mismatch/logprob_abs_max"] for m in lines if "mismatch/logprob_abs_max" in m]
    assert len(mismatches) == (3 if mode == "sync" else 1) and max(mismatches) <= 1e-5
    kept = sorted(p.name for p in (tmp_path / mode / "server_weights").iterdir())  # keep_weights = 2
    assert kept == (["v00000001", "v00000002"] if mode == "sync" else ["v00000002", "v00000003"])


def test_async_run_through_two_servers_survives_one_killed_mid_run(servers, policy, tmp_path):
    """Runs last in this module: it kills the second server, then the first."""
    run_dir, k, steps = tmp_path / "async", 1, 8
    proc = run_cli(*tiny_run(policy, servers, run_dir, "async", steps), f"async.max_staleness={k}",
                   "async.inflight_updates=true", "async.num_workers=1")
    try:
        while len(metrics(run_dir)) < 2 and proc.poll() is None:
            time.sleep(0.02)
        killed_at = len(metrics(run_dir))
        servers[1][1].kill()
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert killed_at < steps  # the kill landed mid-run
    assert f"rollout server {servers[1][0]} is down" in err
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    for m in lines:
        assert REQUIRED_KEYS <= m.keys() and m["staleness/max"] <= k
    mismatches = [m["mismatch/logprob_abs_max"] for m in lines if "mismatch/logprob_abs_max" in m]
    assert mismatches and max(mismatches) <= 1e-5  # from the servers' per-token version tags
    servers[0][1].kill()
    engine = engine_for([servers[0][0]], tmp_path)
    with pytest.raises(ServerError, match="every rollout server is down"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4))
