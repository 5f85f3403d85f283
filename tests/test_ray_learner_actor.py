"""A Ray learner rank, called in this process (no cluster): its optimizer state is answered while its step waits in
a collective, which is what a checkpoint asks of a surviving rank after another rank's node is lost (the step's
all-reduce waits on the dead peer; the old actor held one lock over the whole step, so the checkpoint timed out)."""

from __future__ import annotations

import threading

import pytest
import torch

from test_micro_batches import make_batch
from vcpo.config import load_config

from conftest import save_tiny_policy

pytest.importorskip("ray")


def test_the_optimizer_state_is_answered_while_a_step_waits_and_belongs_to_its_version(tmp_path, monkeypatch):
    import ray

    from vcpo.orchestration.ray.learners import LearnerActor

    # Rank 0 puts its new weights in the object store after each step; here there is no store (a ray.put would start
    # a Ray instance in this process, left running for the modules after this one).
    monkeypatch.setattr(ray, "put", lambda value: value)

    config = load_config(None, ["trainer.lr=1e-2", "trainer.micro_batch_tokens=4096"])
    rank = LearnerActor(config.to_dict(), str(save_tiny_policy(tmp_path / "policy")), rank=0, world_size=1)
    rank.join("127.0.0.1", 0)
    batch = make_batch()
    rank.step(batch, 1e-2)  # step 1: Adam's moments exist
    version, before = rank.optimizer_state()
    assert version == 1 and before["state"]

    in_collective, peer_back = threading.Event(), threading.Event()
    backward = rank.learner.backward

    def waiting_backward(b):  # a step's collectives run in its backward (the gradient all-reduce)
        out = backward(b)
        in_collective.set()
        assert peer_back.wait(30)
        return out

    rank.learner.backward = waiting_backward
    step = threading.Thread(target=rank.step, args=(batch, 1e-2))
    step.start()
    try:
        assert in_collective.wait(30)
        answered: dict = {}
        reader = threading.Thread(target=lambda: answered.update(state=rank.optimizer_state()))
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "the optimizer state waited for the step"
        version, during = answered["state"]
        assert version == 1  # step 2 has not changed the state yet: the state of step 1, named so
        for index, moments in before["state"].items():
            assert torch.equal(during["state"][index]["exp_avg"], moments["exp_avg"])
    finally:
        peer_back.set()
        step.join(30)
    version, after = rank.optimizer_state()
    assert version == 2 and not torch.equal(after["state"][0]["exp_avg"], during["state"][0]["exp_avg"])
    # The answer is a copy: the step that followed did not change what was handed out.
    assert torch.equal(during["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
    assert not ray.is_initialized()
