"""The Ray backend on a local Ray instance (one per module, 4 logical CPUs): the staleness bound across rollout
actors finishing out of order, a killed rollout actor restarted with its groups re-issued, and through the command
line 2 rollout actors and 2 learner ranks, a learner killed mid-run (one line, a checkpoint), resumes from a Ray
run's checkpoint locally and from a local one on Ray, 2 rollout actors generating on 2 `vcpo serve` processes
(one killed mid-run), and the weight broadcast (``ray.weight_sync=broadcast``, gloo): the actors' weights equal
learner rank 0's exactly, the group formed again after an actor restart, and a run through the command line; two
FSDP-sharded learner ranks feeding a rollout actor, their checkpoint resumed locally; dynamic sampling refilling
from 2 rollout actors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_dynamic_sampling import FILTER, check_filtered_run
from test_e2e_cli import REQUIRED_KEYS, metrics
from vcpo.config import RayConfig, TaskConfig, load_config
from vcpo.models.default import build_default_model
from vcpo.models.loading import load_policy
from vcpo.tasks import make_task
from vcpo.types import Batch, SamplingParams

from conftest import ROOT, save_tiny_policy, serving, vcpo

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster() -> str:
    """The local Ray instance a run with ``ray.address: null`` starts (4 CPUs, localhost), kept for the module;
    command-line runs join it by its address."""
    import signal

    from vcpo.orchestration.ray.session import RaySession

    before = signal.getsignal(signal.SIGTERM)
    with RaySession(load_config(None, ["async.backend=ray", "ray.num_cpus=4"])) as session:
        assert session.owned and ray.cluster_resources()["CPU"] == 4
        # ray.init installs a SIGTERM handler of its own; vcpo's must stay in charge (checkpoint, exit 143).
        assert signal.getsignal(signal.SIGTERM) is before
        yield ray.get_runtime_context().gcs_address
    assert not ray.is_initialized() and signal.getsignal(signal.SIGTERM) is before


def live_actor_pids(cls: str) -> list[int]:
    """The PIDs of the live actors of class ``cls`` on the Ray instance this process is connected to."""
    from ray._private import state

    return sorted(a["Pid"] for a in state.actors().values() if a["ActorClassName"] == cls and a["State"] == "ALIVE")


def tiny_worker(tmp_path):
    """The embedded default model (untrained) and a rollout worker's spec for it: 4 prompts x 2, 6 new tokens."""
    from vcpo.orchestration.worker import WorkerSpec

    task_config = TaskConfig()
    path = build_default_model(make_task(task_config), 0, tmp_path / "model")
    model, _ = load_policy(path, "float32", torch.device("cpu"))
    spec = WorkerSpec(worker_id=0, model_path=str(path), dtype="float32", device="cpu", lm_head_fp32=False,
                      task_name=task_config.name, task_kwargs=task_config.kwargs, seed=0, prompts_per_step=4,
                      group_size=2, sampling=SamplingParams(max_new_tokens=6), inflight_updates=True)
    return model, spec


def test_bound_holds_across_jittery_actors_and_a_killed_actor_is_restarted(cluster, tmp_path):
    from vcpo.orchestration.ray.rollout import RaySource
    from vcpo.orchestration.ray.weights import WeightBoard

    model, spec = tiny_worker(tmp_path)
    k = 1
    # Up to 20 ms before each decode step: the two actors finish out of order, mid-response weight updates happen.
    source = RaySource(model, spec, 2, k, None, 0, WeightBoard(), RayConfig(max_restarts=1, timeout_s=120),
                       jitter_s=0.02)
    try:
        seen: set[int] = set()
        restarted_at = None
        for version in range(40):  # until the death is seen (Ray reports it within seconds), then 3 steps more
            batch = source.next_batch(version)
            assert max(version - v for t in batch for v in t.versions) <= k  # no token ever lags more than k
            groups = {t.group_id for t in batch}
            assert len(groups) == 4 and not groups & seen  # whole groups, none trained twice
            seen |= groups
            if version == 1:
                os.kill(source.pids()[0], signal.SIGKILL)
            with torch.no_grad():  # a new policy each step, so versions matter
                next(model.parameters()).add_(1e-3)
            source.publish(model, version + 1)
            if restarted_at is None and source.stats["ray/actor_restarts"]:
                restarted_at = version
            if restarted_at is not None and version >= restarted_at + 3:
                break
        m = source.metrics()
        assert m["ray/actor_restarts"] == 1 and m["ray/reissued_groups"] >= 1  # one death, its groups sent again
        deadline = time.monotonic() + 120
        while True:  # the restarted actor answers once its engine is built again
            try:
                assert len(set(source.pids())) == 2
                break
            except ray.exceptions.ActorUnavailableError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
    finally:
        source.close()


def _run_in_background(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with log.open("w") as stderr:  # the child has its own copy of the descriptor: this one closes at once
        return subprocess.Popen([sys.executable, "-m", "vcpo.cli", *args], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)


@pytest.mark.slow
def test_dynamic_sampling_refills_from_two_rollout_actors_through_the_cli(cluster, tmp_path, tiny):
    run = tmp_path / "run"
    vcpo("train", *tiny, f"run_dir={run}", "async.mode=async", "async.backend=ray", "async.num_workers=2",
         "async.max_staleness=1", "trainer.max_steps=3", "ray.timeout_s=60", f"ray.address={cluster}", *FILTER)
    check_filtered_run(run, 3, 1)


def test_a_resumed_ray_source_trains_every_admitted_group_once(cluster, tmp_path):
    """What an async checkpoint keeps on Ray (as for local workers, tests/test_fault_injection.py): the groups the
    actors finished and those in flight at a stop are trained after the resume, none skipped, none twice."""
    from vcpo.orchestration.ray.rollout import RaySource
    from vcpo.orchestration.ray.weights import WeightBoard

    model, spec = tiny_worker(tmp_path)

    def source(start_version: int) -> RaySource:  # k = 8 > 7: no group of 8 steps is ever dropped
        return RaySource(model, spec, 1, 8, None, start_version, WeightBoard(), RayConfig(timeout_s=120))

    def step(src: RaySource, version: int) -> list[int]:
        groups = sorted({t.group_id for t in src.next_batch(version)})
        src.publish(model, version + 1)
        return groups

    first = source(0)
    try:
        trained = [g for version in range(2) for g in step(first, version)]
        deadline = time.monotonic() + 60  # the actor runs ahead by up to (k + 1) x 4 groups: wait until some finish
        while not ray.wait(list(first.inflight), timeout=0)[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        state = json.loads(json.dumps(first.state()))  # as trainer_state.json holds it
    finally:
        first.close()
    queued = [g[0]["group_id"] for g in state["queued"]]
    assert queued and set(queued).isdisjoint(state["requeued"]) and state["next_group"] > 8
    assert set(queued) | set(state["requeued"]) == set(range(8, state["next_group"]))  # every admitted group kept
    second = source(2)
    try:
        second.load_state(state)
        resumed = [step(second, version) for version in range(2, 8)]
    finally:
        second.close()
    after = [g for groups in resumed for g in groups]
    assert sorted(after[:len(queued)]) == sorted(queued)  # the finished ones first (one actor: in stream order)
    # none skipped (a resume at the cursor skipped 8..next_group - 1), none twice
    assert sorted(trained + after) == list(range(32))



@pytest.mark.slow
def test_two_actors_two_learners_through_the_cli_a_learner_killed_and_resumes(cluster, tmp_path):
    """A local run's checkpoint (sync mode: no worker process to start) resumed on Ray (2 rollout actors, 2 learner
    ranks), a learner killed mid-run (one line, exit 1, every finished step checkpointed), that Ray checkpoint
    resumed locally."""
    run = tmp_path / "run"
    k = 1
    # No warm start (sft.steps=0): the plumbing is under test, not learning.
    common = ["-c", "configs/quickstart.yaml", f"sft.cache_dir={tmp_path / 'cache'}", "sft.steps=0",
              "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "task.eval_size=8",
              "trainer.eval_every=0", "trainer.checkpoint_every=2", "logging.progress=false", "trainer.lr=1e-3",
              f"async.max_staleness={k}", "async.inflight_updates=true"]
    vcpo("train", *common, f"run_dir={run}", "trainer.max_steps=2", "async.mode=sync")  # local, no worker process
    log = tmp_path / "stderr.txt"
    proc = _run_in_background(["train", "--resume", str(run), "trainer.max_steps=200", "async.mode=async",
                               "async.backend=ray",
                               "async.num_workers=2", "trainer.num_learners=2", "ray.timeout_s=60",
                               f"ray.address={cluster}"], log)
    try:
        deadline = time.monotonic() + 300
        while len(metrics(run)) < 5:  # 3 steps on Ray
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        learners = live_actor_pids("LearnerActor")  # this module's instance: another module's may still be exiting
        assert len(learners) == 2
        os.kill(learners[1], signal.SIGKILL)
        assert proc.wait(timeout=120) == 1
    finally:
        proc.kill()
    last = log.read_text().strip().splitlines()[-1]
    # The killed rank's death or, when gloo reports it first, its peer's failed collective: either way one line.
    assert last.startswith("error: stopped at step") and "learner rank" in last, last
    assert "died" in last or "Connection reset by peer" in last or "Connection closed by peer" in last, last
    lines = metrics(run)
    assert [m["step"] for m in lines] == list(range(1, len(lines) + 1))
    for m in lines:
        assert REQUIRED_KEYS <= m.keys() and m["staleness/max"] <= k
    assert all({"time/weight_sync_s", "ray/actor_restarts"} <= m.keys() for m in lines[2:])  # the Ray steps
    saved = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert saved == len(lines) >= 5  # every finished step was checkpointed when the learner died

    vcpo("train", "--resume", str(run), f"trainer.max_steps={saved + 1}", "async.backend=local",
         "trainer.num_learners=1", "async.mode=sync")
    lines = metrics(run)
    assert [m["step"] for m in lines] == list(range(1, saved + 2)) and "time/weight_sync_s" not in lines[-1]
    assert json.loads((run / "summary.json").read_text())["steps"] == saved + 1


@pytest.mark.slow
def test_two_actors_on_two_servers_through_the_cli_one_server_killed(cluster, tmp_path):
    """``async.backend=ray`` with ``rollout.engine=server``: the driver publishes each version to both servers once,
    the 2 rollout actors generate through both; the second server is killed after step 2 and the run carries on."""
    policy = save_tiny_policy(tmp_path / "policy")
    run, k, steps = tmp_path / "run", 1, 6
    with serving(policy, count=2) as servers:
        urls = ",".join(u for u, _ in servers)
        log = tmp_path / "stderr.txt"
        proc = _run_in_background([
            "train", "-c", "configs/quickstart.yaml", f"run_dir={run}", f"model.path={policy}",
            "rollout.engine=server", f"rollout.server.urls=[{urls}]", "rollout.server.retries=1",
            "rollout.server.retry_backoff_s=0.05", "async.mode=async", "async.backend=ray", "async.num_workers=2",
            f"async.max_staleness={k}", "async.inflight_updates=true", f"trainer.max_steps={steps}",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=12", "task.eval_size=8",
            "trainer.eval_every=0", "trainer.checkpoint_every=0", "logging.progress=false", "trainer.lr=1e-3",
            "ray.timeout_s=120", f"ray.address={cluster}"], log)
        try:
            deadline = time.monotonic() + 300
            while len(metrics(run)) < 2:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.05)
            killed_at = len(metrics(run))
            servers[1][1].kill()
            assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
        finally:
            proc.kill()
        assert killed_at < steps  # the kill landed mid-run
        assert f"rollout server {servers[1][0]} is down" in log.read_text()  # the driver's publisher saw it
        import httpx

        assert httpx.get(servers[0][0] + "/health").json()["version"] == steps  # each version published
    lines = metrics(run)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    for m in lines:
        assert REQUIRED_KEYS <= m.keys() and m["staleness/max"] <= k
        assert {"time/weight_publish_s", "time/weight_sync_s", "ray/actor_restarts"} <= m.keys()
        assert m["ray/weight_loads"] == 0  # the actors never fetch weights: the servers hold them
    # Tokens sampled at the learner's version (by the servers' per-token tags: a token tagged with the wrong version
    # would be off by the update's change), recomputed by the learner:
    mismatches = [m["mismatch/logprob_abs_max"] for m in lines if "mismatch/logprob_abs_max" in m]
    assert mismatches and max(mismatches) <= 1e-5
    assert sorted(p.name for p in (run / "server_weights").iterdir()) == [f"v{steps - 1:08d}", f"v{steps:08d}"]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_broadcast_gives_every_actor_rank_0s_weights_exactly_and_forms_again_after_a_restart(cluster, tmp_path):
    from vcpo.orchestration.ray import RayBackend
    from vcpo.orchestration.ray.session import get
    from vcpo.orchestration.ray.weights import host_state_dict
    from vcpo.orchestration.worker import WorkerSpec

    config = load_config(None, ["async.backend=ray", "async.mode=async", "async.num_workers=2", "async.max_staleness=1",
                                "ray.weight_sync=broadcast", "ray.timeout_s=40", "ray.max_restarts=1",
                                "trainer.lr=1e-2", "trainer.weight_decay=0.1",  # moves the weights whatever the rewards
                                f"run_dir={tmp_path / 'run'}"])
    path = build_default_model(make_task(config.task), 0, tmp_path / "model")
    model, tokenizer = load_policy(path, "float32", torch.device("cpu"))
    spec = WorkerSpec(worker_id=0, model_path=str(path), dtype="float32", device="cpu", lm_head_fp32=False,
                      task_name=config.task.name, task_kwargs=config.task.kwargs, seed=0, prompts_per_step=4,
                      group_size=2, sampling=SamplingParams(max_new_tokens=4), inflight_updates=True)
    with RayBackend(config) as backend:  # joins the module's Ray instance
        learner = backend.learner(model, str(path))
        source = backend.source(model, spec, start_version=0)

        def step() -> dict[str, float]:
            """One learner step and its broadcast (the driver's mirror gets rank 0's weights via the object store)."""
            batch = source.next_batch(learner.version)
            learner.step(Batch.from_trajectories(batch, pad_id=tokenizer.pad_token_id))
            source.publish(model, learner.version)
            return source.metrics()

        def check() -> None:
            """Every actor's engine holds rank 0's newest weights exactly (a request swaps in what it received)."""
            for actor in source.actors:
                get(actor.generate.remote([10_000], learner.version, [None]), 60, "a request")
                version, weights = get(actor.weights.remote(), 60, "the actor's weights")
                assert version == learner.version and _same(weights, host_state_dict(model))

        start = host_state_dict(model)
        m = step()
        assert not _same(start, host_state_dict(model))  # the step moved the weights
        check()
        assert m["ray/broadcast_groups"] == 1 and m["ray/broadcast_fallbacks"] == 0 and m["time/weight_broadcast_s"] > 0
        os.kill(source.pids()[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        # The broadcast to the dead actor fails; the versions after it go by the object store until the death is seen,
        # the actor restarted and ray.timeout_s passed (the survivor's receive from the failed broadcast timed out):
        while m["ray/broadcast_groups"] < 2:
            assert time.monotonic() < deadline
            m = step()
        check()
        assert m["ray/actor_restarts"] == 1 and m["ray/broadcast_fallbacks"] >= 1 and m["time/weight_broadcast_s"] > 0


@pytest.mark.slow
def test_weight_broadcast_through_the_cli(cluster, tmp_path):
    """``ray.weight_sync=broadcast``: 2 rollout actors get every learner version from rank 0 over gloo, rank 0 being
    also a member of the 2 learners' own group."""
    run, k, steps = tmp_path / "run", 1, 4
    vcpo("train", "-c", "configs/quickstart.yaml", f"run_dir={run}", f"sft.cache_dir={tmp_path / 'cache'}",
         "sft.steps=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
         "task.eval_size=8", "trainer.eval_every=0", "trainer.checkpoint_every=0", "logging.progress=false",
         f"trainer.max_steps={steps}", "async.mode=async", "async.backend=ray", "async.num_workers=2",
         f"async.max_staleness={k}", "async.inflight_updates=true", "trainer.num_learners=2",
         "ray.weight_sync=broadcast", "ray.timeout_s=120", f"ray.address={cluster}")
    lines = metrics(run)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    for m in lines:
        assert REQUIRED_KEYS <= m.keys() and m["staleness/max"] <= k
        assert m["time/weight_broadcast_s"] > 0 and m["ray/broadcast_fallbacks"] == 0
    assert lines[-1]["ray/broadcast_groups"] == 1  # formed once, at the first learner version
    # Only the start version (the driver's weights, not rank 0's) went through the object store: once per actor.
    assert sum(m["ray/weight_loads"] for m in lines) <= 2


@pytest.mark.slow
def test_two_sharded_learner_ranks_through_the_cli_and_their_checkpoint_resumed_locally(cluster, tmp_path):
    """``trainer.sharding=fsdp`` in the Ray learner group: the rollout actor samples from the weights the 2 sharded
    ranks gathered layer by layer (k = 0: every token at the learner's current weights, its log-probs the learner's to
    float rounding), the checkpoint is the ranks' shards, and one local process resumes it."""
    run, steps = tmp_path / "run", 4
    common = ["-c", "configs/quickstart.yaml", f"sft.cache_dir={tmp_path / 'cache'}", "sft.steps=0",
              "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "task.eval_size=8",
              "trainer.eval_every=0", "logging.progress=false", "trainer.lr=1e-3"]
    vcpo("train", *common, f"run_dir={run}", f"trainer.max_steps={steps}", "trainer.checkpoint_every=2",
         "async.mode=async", "async.backend=ray", "async.max_staleness=0", "trainer.num_learners=2",
         "trainer.sharding=fsdp", "ray.timeout_s=120", f"ray.address={cluster}")
    lines = metrics(run)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert all(m["mismatch/logprob_abs_max"] <= 1e-5 for m in lines)
    assert any(m["grad_norm"] > 0 for m in lines[:-1])  # some update reached the actor before a later step
    assert (run / "checkpoints" / "step_000004" / "sharded").is_dir()
    vcpo("train", "--resume", str(run), f"trainer.max_steps={steps + 1}", "async.backend=local",
         "trainer.num_learners=1", "trainer.sharding=none", "async.mode=sync")
    assert [m["step"] for m in metrics(run)] == list(range(1, steps + 2))


def test_a_bound_lowered_and_raised_live_holds_for_every_batch(cluster, tmp_path):
    """async.max_staleness: auto on Ray: the driver's admission bound changes between steps (set_bound)."""
    from vcpo.orchestration.ray.rollout import RaySource
    from vcpo.orchestration.ray.weights import WeightBoard

    model, spec = tiny_worker(tmp_path)
    source = RaySource(model, spec, 2, 3, None, 0, WeightBoard(), RayConfig(timeout_s=120), jitter_s=0.01)
    schedule, k = {4: 0, 8: 2}, 3
    try:
        for version in range(11):
            batch = source.next_batch(version)
            assert max(version - v for t in batch for v in t.versions) <= k
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)
            if version + 1 in schedule:
                k = schedule[version + 1]
                source.set_bound(k)
            source.publish(model, version + 1)
        assert source.controller.k == 2
    finally:
        source.close()


def test_a_step_a_surviving_rank_finished_is_kept_when_its_peer_died(cluster):
    """A rank dies while its peer's all-reduce had already completed: the survivor holds the group's next weights and
    optimizer state, so the step is kept (its answers, and weights the survivor puts in the store when rank 0 is the
    dead one), and the checkpoint that follows finds a rank at the driver's version. A step no survivor finished is
    not kept."""
    from vcpo.orchestration.ray.learners import LearnerGroup

    @ray.remote(max_restarts=0)
    class Rank:
        def __init__(self, dies: bool) -> None:
            self.dies = dies

        def step(self, batch, lr):
            if self.dies:
                os._exit(1)
            return {"loss/value": 0.5}, None, None

        def put_weights(self):
            return ray.put({"w": torch.ones(2)})

    group = object.__new__(LearnerGroup)
    group.timeout_s, group.sharded = 60, False
    group.actors = [Rank.remote(True), Rank.remote(False)]  # rank 0 dies, rank 1 finishes
    metrics, weights, skip_reason = group._taken_by_a_survivor([a.step.remote(None, 1e-3) for a in group.actors])
    assert metrics == {"loss/value": 0.5} and skip_reason is None  # rank 1's answer
    assert torch.equal(ray.get(weights[0])["w"], torch.ones(2))
    group.actors = [Rank.remote(True), Rank.remote(True)]
    assert group._taken_by_a_survivor([a.step.remote(None, 1e-3) for a in group.actors]) is None
