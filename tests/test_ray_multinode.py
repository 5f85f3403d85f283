"""The Ray backend on a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: each node its own
raylet and object store, all on 127.0.0.1): rollout actors placed by custom resources on other nodes than the
learner, a whole node removed mid-run (its actor restarted on a survivor, its groups re-issued, every step logged
within the staleness bound), the weight broadcast formed again after a node loss, a learner rank's node removed
(checkpoint, one line, exit 1) and the run resumed on a cluster of another shape. The cluster is the module's; every
process it started is gone after the module, also when a test fails (``local_cluster``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from test_e2e_cli import REQUIRED_KEYS
from vcpo.config import RayConfig, load_config
from vcpo.models.default import build_default_model
from vcpo.models.loading import load_policy
from vcpo.orchestration.base import BackendError
from vcpo.tasks import make_task
from vcpo.testing.faults import start_train
from vcpo.types import Batch, SamplingParams

from conftest import ROOT, metrics

ray = pytest.importorskip("ray")

K = 1  # the staleness bound of every run here
TINY = ["-c", "configs/quickstart.yaml", "sft.steps=0", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "rollout.max_new_tokens=6", "task.eval_size=8", "trainer.eval_every=0", "logging.progress=false",
        "trainer.lr=1e-3", "async.mode=async", "async.backend=ray", f"async.max_staleness={K}",
        "async.inflight_updates=true", "ray.learner_resources={learner: 1}", "ray.rollout_resources={rollout: 1}"]
"""A tiny Ray run (no warm start: the plumbing is under test, not learning): learner ranks need the ``learner``
resource (the head node's), rollout actors the ``rollout`` resource (worker nodes only)."""


class Nodes:
    """The module's cluster and its worker nodes by name (a test may remove one and add another)."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.by_name = {"a": cluster.add({"rollout": 4}, num_cpus=4), "b": cluster.add({"rollout": 2}, num_cpus=2)}

    def id(self, name: str) -> str:
        return self.cluster.head.node_id if name == "head" else self.by_name[name].node_id

    def remove(self, name: str) -> None:
        self.cluster.remove(self.by_name.pop(name))

    def add(self, name: str, resources: dict[str, float], num_cpus: int = 2) -> None:
        self.by_name[name] = self.cluster.add(resources, num_cpus=num_cpus)


@pytest.fixture(scope="module")
def nodes():
    """Head (the driver's node; ``learner: 1``), ``a`` (``rollout: 4``) and ``b`` (``rollout: 2``)."""
    from vcpo.testing.ray_cluster import local_cluster

    with local_cluster(head={"learner": 1}, head_cpus=2) as cluster:
        yield Nodes(cluster)


def actors(cls: str, job: str | None = None) -> list[dict]:
    """The GCS's record of every actor of class ``cls`` (of driver job ``job``, hex, when given)."""
    from ray._private import state

    return [a for a in state.actors().values() if a["ActorClassName"] == cls and (job is None or a["JobID"] == job)]


def _ray_job_of_run() -> str:
    """The job id of the newest driver other than this process (the `vcpo train` a test started)."""
    from ray._private import state

    mine = ray.get_runtime_context().get_job_id()
    jobs = [j for j in state.jobs() if j["JobID"] != mine and not j["IsDead"]]
    return max(jobs, key=lambda j: j["StartTime"])["JobID"]


def _wait_lines(run: Path, n: int, proc, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while len(metrics(run)) < n:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def _check_steps(run: Path, steps: int) -> list[dict]:
    """Every step 1..steps logged once, none over the bound."""
    lines = metrics(run)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    for m in lines:
        assert REQUIRED_KEYS <= m.keys() and m["staleness/max"] <= K
    return lines


def test_what_the_cluster_cannot_hold_is_one_line(nodes):
    from vcpo.orchestration.ray.placement import LearnerPlacement, rollout_options

    with pytest.raises(BackendError, match=r"^no node of the Ray cluster can hold a rollout actor \(\{CPU: 1, gpu_box: "
                                           r"1\}: ray.worker_num_cpus/gpus, ray.rollout_resources\); live nodes: "):
        rollout_options(RayConfig(rollout_resources={"gpu_box": 1}))
    t0 = time.monotonic()
    # Two ranks of `learner: 1` on two nodes: only the head has it. Neither rank starts.
    with pytest.raises(BackendError, match=r"^the learner group \(2 ranks of \{CPU: 1, learner: 1\}, placement "
                                           r"strict_spread\) did not fit the Ray cluster within "
                                           r"ray.placement_timeout_s=2 s; live nodes: "):
        LearnerPlacement(RayConfig(learner_resources={"learner": 1}, learner_placement="strict_spread",
                                   placement_timeout_s=2), 2)
    assert time.monotonic() - t0 < 10
    assert ray.util.placement_group_table() and all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())  # nothing left reserved


def test_rollout_actors_on_other_nodes_and_a_node_removed_mid_run(nodes, tmp_path):
    """The learner on the head, the 2 rollout actors spread over nodes a and b; b is removed after step 2: its actor
    is restarted on a, its groups re-issued, and the run logs every step within the bound."""
    run, log, steps = tmp_path / "run", tmp_path / "log.txt", 10
    proc = start_train([*TINY, f"run_dir={run}", f"sft.cache_dir={tmp_path / 'cache'}", f"trainer.max_steps={steps}",
                        "trainer.checkpoint_every=0", "async.num_workers=2", "ray.max_restarts=2", "ray.timeout_s=60",
                        f"ray.address={nodes.cluster.address}"], log, ROOT)
    try:
        _wait_lines(run, 2, proc, log)
        job = _ray_job_of_run()
        [learner] = actors("LearnerActor", job)
        assert learner["Address"]["NodeID"] == nodes.id("head")
        rollout = actors("RolloutActor", job)
        assert sorted(a["Address"]["NodeID"] for a in rollout) == sorted([nodes.id("a"), nodes.id("b")])
        a_id = nodes.id("a")
        nodes.remove("b")
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    lines = _check_steps(run, steps)
    assert lines[-1]["ray/actor_restarts"] == 1 and lines[-1]["ray/reissued_groups"] >= 1
    moved = [a for a in actors("RolloutActor", job) if a["NumRestarts"] == 1]
    assert len(moved) == 1 and moved[0]["Address"]["NodeID"] == a_id  # restarted on the survivor
    assert json.loads((run / "summary.json").read_text())["steps"] == steps
    nodes.add("b", {"rollout": 2})  # the next test's shape


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_broadcast_forms_again_after_a_node_loss(nodes, tmp_path):
    """``ray.weight_sync=broadcast`` from learner rank 0 (head) to actors on nodes a and b; b is removed: the
    broadcast fails, the versions go by the object store, and once the actor is back (on a) a new group forms and
    every actor again holds rank 0's weights exactly."""
    from vcpo.orchestration.ray import RayBackend
    from vcpo.orchestration.ray.session import get
    from vcpo.orchestration.ray.weights import host_state_dict
    from vcpo.orchestration.worker import WorkerSpec

    config = load_config(None, ["async.backend=ray", "async.mode=async", "async.num_workers=2", "async.max_staleness=1",
                                "ray.weight_sync=broadcast", "ray.timeout_s=20", "ray.max_restarts=1",
                                "ray.rollout_resources={rollout: 1}", "ray.learner_resources={learner: 1}",
                                "trainer.lr=1e-2", "trainer.weight_decay=0.1", f"run_dir={tmp_path / 'run'}"])
    path = build_default_model(make_task(config.task), 0, tmp_path / "model")
    model, tokenizer = load_policy(path, "float32", torch.device("cpu"))
    spec = WorkerSpec(worker_id=0, model_path=str(path), dtype="float32", device="cpu", lm_head_fp32=False,
                      task_name=config.task.name, task_kwargs=config.task.kwargs, seed=0, prompts_per_step=4,
                      group_size=2, sampling=SamplingParams(max_new_tokens=4), inflight_updates=True)
    with RayBackend(config) as backend:  # joins the module's cluster
        learner = backend.learner(model, str(path))
        source = backend.source(model, spec, start_version=0)

        def step() -> dict[str, float]:
            batch = source.next_batch(learner.version)
            learner.step(Batch.from_trajectories(batch, pad_id=tokenizer.pad_token_id))
            source.publish(model, learner.version)
            return source.metrics()

        def check() -> None:
            for actor in source.actors:
                get(actor.generate.remote([10_000], learner.version, [None]), 60, "a request")
                version, weights = get(actor.weights.remote(), 60, "the actor's weights")
                assert version == learner.version and _same(weights, host_state_dict(model))

        assert learner.nodes() == [nodes.id("head")]
        assert sorted(source.nodes()) == sorted([nodes.id("a"), nodes.id("b")])
        m = step()
        check()
        assert m["ray/broadcast_groups"] == 1 and m["ray/broadcast_fallbacks"] == 0
        nodes.remove("b")
        deadline = time.monotonic() + 150
        while m["ray/broadcast_groups"] < 2:  # ray.timeout_s after the failed broadcast, with the restarted actor
            assert time.monotonic() < deadline
            m = step()
        check()
        assert m["ray/actor_restarts"] == 1 and m["ray/broadcast_fallbacks"] >= 1 and m["time/weight_broadcast_s"] > 0
        assert source.nodes() == [nodes.id("a")] * 2
    nodes.add("l", {"learner": 1})  # the next test's shape: a second node for learners


def test_a_learner_nodes_loss_then_a_resume_on_another_shape(nodes, tmp_path):
    """2 learner ranks on 2 nodes (head and l: a placement group, strict_spread), 2 rollout actors on a; node l is
    removed after step 3: the run checkpoints every finished step and exits 1 with one line. It resumes on what is
    left (1 learner rank, 3 rollout actors) and logs every step once."""
    run, log = tmp_path / "run", tmp_path / "log.txt"
    common = [*TINY, f"run_dir={run}", f"sft.cache_dir={tmp_path / 'cache'}", "ray.timeout_s=60",
              f"ray.address={nodes.cluster.address}"]
    proc = start_train([*common, "trainer.max_steps=200", "trainer.checkpoint_every=2", "async.num_workers=2",
                        "trainer.num_learners=2", "ray.learner_placement=strict_spread"], log, ROOT)
    try:
        _wait_lines(run, 3, proc, log)
        job = _ray_job_of_run()
        assert sorted(a["Address"]["NodeID"] for a in actors("LearnerActor", job)) == sorted(
            [nodes.id("head"), nodes.id("l")])
        assert {a["Address"]["NodeID"] for a in actors("RolloutActor", job)} == {nodes.id("a")}
        nodes.remove("l")
        assert proc.wait(timeout=120) == 1, log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("error: stopped at step") and "learner rank" in last, last
    assert last.endswith(f"continue with --resume {run}"), last
    saved = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert saved == len(_check_steps(run, len(metrics(run)))) >= 3  # every finished step checkpointed

    proc = start_train(["--resume", str(run), f"trainer.max_steps={saved + 3}", "trainer.num_learners=1",
                        "async.num_workers=3", f"ray.address={nodes.cluster.address}"], log, ROOT)
    try:
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    lines = _check_steps(run, saved + 3)
    assert lines[-1]["ray/actor_restarts"] == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == saved + 3
