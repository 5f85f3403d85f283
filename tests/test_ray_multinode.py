"""The Ray backend on a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: each node its own
raylet and object store, all on 127.0.0.1): what the cluster cannot hold is one line; one run through the command
line with its rollout actors and learner ranks placed by custom resources on other nodes, a rollout node removed
mid-run (its actor restarted on a survivor, its groups re-issued, the weight broadcast formed again, every step logged
within the staleness bound), then a learner rank's node removed (checkpoint, one line, exit 1), and the run resumed
on a cluster of another shape. The cluster is the module's; every process it started is gone after the module, also
when a test fails (``vcpo.testing.ray_cluster.local_cluster``)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_e2e_cli import REQUIRED_KEYS
from vcpo.config import RayConfig
from vcpo.orchestration.base import BackendError
from vcpo.testing.faults import start_train

from conftest import ROOT, metrics, processes_with

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

    before = signal.getsignal(signal.SIGTERM)
    # A process of the driver's own from before (as a reward pool's worker is): not the cluster's to end.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])
    try:
        with local_cluster(head={"learner": 1}, head_cpus=2) as cluster:
            session = Path(cluster.head.get_session_dir_path()).name
            yield Nodes(cluster)
        assert not processes_with(session)  # no raylet, GCS or agent of this cluster left
        assert bystander.poll() is None  # the cluster's teardown ended only the cluster's processes
        assert signal.getsignal(signal.SIGTERM) is before  # Ray's handler gone: later tests in this process see theirs
    finally:
        bystander.kill()
        bystander.wait()


def actors(cls: str, job: str | None = None) -> list[dict]:
    """The GCS's record of every actor of class ``cls`` (of driver job ``job``, hex, when given)."""
    from ray._private import state

    return [a for a in state.actors().values() if a["ActorClassName"] == cls and (job is None or a["JobID"] == job)]


def _ray_job_of_run() -> str:
    """The job id of the newest driver other than this process (the `vcpo train` a test started last)."""
    from ray._private import state

    mine = ray.get_runtime_context().get_job_id()
    jobs = [j for j in state.jobs() if j["JobID"] != mine]
    return max(jobs, key=lambda j: j["StartTime"])["JobID"]


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
                                           r"ray.start_timeout_s=2 s; live nodes: "):
        LearnerPlacement(RayConfig(learner_resources={"learner": 1}, learner_placement="strict_spread",
                                   start_timeout_s=2), 2)
    assert time.monotonic() - t0 < 10
    assert ray.util.placement_group_table() and all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())  # nothing left reserved


def _wait_for(run: Path, proc, log: Path, done, what: str, timeout_s: float = 240) -> list[dict]:
    """The run's metric lines once ``done(lines)``; the run must still be going meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not done(lines := metrics(run)):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.2)
    return lines


@pytest.mark.slow
def test_nodes_lost_mid_run_then_a_resume_on_another_shape(nodes, tmp_path):
    """One run through the command line: 2 learner ranks in a strict_spread placement group (head and node l), 2
    rollout actors spread over nodes a and b, weights broadcast by rank 0. Node b is removed: its actor is restarted
    on a, its groups re-issued, the broadcast fails over to the object store and forms again with the restarted
    actor, and every step is logged within the bound. Then node l is removed: the run checkpoints every finished step
    and exits 1 with one line. It resumes on what is left with another shape (1 learner rank, 3 rollout actors)."""
    run, log = tmp_path / "run", tmp_path / "log.txt"
    common = [*TINY, f"run_dir={run}", f"sft.cache_dir={tmp_path / 'cache'}", f"ray.address={nodes.cluster.address}"]
    nodes.add("l", {"learner": 1})
    proc = start_train([*common, "trainer.max_steps=1000", "trainer.checkpoint_every=0", "async.num_workers=2",
                        "trainer.num_learners=2", "ray.learner_placement=strict_spread", "ray.max_restarts=2",
                        "ray.weight_sync=broadcast", "ray.timeout_s=15", "ray.start_timeout_s=240"], log, ROOT)
    try:
        _wait_for(run, proc, log, lambda lines: len(lines) >= 2, "2 steps")
        job = _ray_job_of_run()
        assert sorted(a["Address"]["NodeID"] for a in actors("LearnerActor", job)) == sorted(
            [nodes.id("head"), nodes.id("l")])
        assert sorted(a["Address"]["NodeID"] for a in actors("RolloutActor", job)) == sorted(
            [nodes.id("a"), nodes.id("b")])  # spread, never on a learner's node (no rollout resource there)
        nodes.remove("b")
        # The actor restarted on a, then (ray.timeout_s after the failed broadcast) a new group formed with it:
        lines = _wait_for(run, proc, log, lambda lines: lines and lines[-1]["ray/broadcast_groups"] >= 2,
                          "the broadcast formed again")
        rollout = actors("RolloutActor", job)
        assert [a["Address"]["NodeID"] for a in rollout] == [nodes.id("a")] * 2
        assert sorted(a["NumRestarts"] for a in rollout) == [0, 1]
        lost = len(lines)
        nodes.remove("l")
        assert proc.wait(timeout=120) == 1, log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("error: stopped at step") and "learner rank" in last, last
    assert last.endswith(f"continue with --resume {run}"), last
    lines = _check_steps(run, len(metrics(run)))
    saved = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert saved == len(lines) >= lost  # every finished step checkpointed
    after = lines[lost - 1]
    assert after["ray/actor_restarts"] == 1 and after["ray/reissued_groups"] >= 1
    assert after["ray/broadcast_fallbacks"] >= 1 and after["time/weight_broadcast_s"] > 0

    # Resume on head + a: 1 learner rank (the head's), 3 rollout actors (all on a), object-store weights.
    proc = start_train(["--resume", str(run), f"trainer.max_steps={saved + 3}", "trainer.num_learners=1",
                        "async.num_workers=3", "ray.weight_sync=object_store",
                        f"ray.address={nodes.cluster.address}"], log, ROOT)
    try:
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    job = _ray_job_of_run()
    assert [a["Address"]["NodeID"] for a in actors("LearnerActor", job)] == [nodes.id("head")]
    assert [a["Address"]["NodeID"] for a in actors("RolloutActor", job)] == [nodes.id("a")] * 3
    lines = _check_steps(run, saved + 3)
    assert lines[-1]["ray/actor_restarts"] == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == saved + 3
