"""What the trainer asks of the Ray backend: a session for the run, the learner group and the rollout source,
sharing one ``WeightBoard`` so that each version goes into the object store once."""

from __future__ import annotations

from typing import Any

import torch

from vcpo.config import Config
from vcpo.orchestration.filtering import DynamicSampling
from vcpo.orchestration.ray.session import RaySession
from vcpo.orchestration.worker import WorkerSpec
from vcpo.rollout.weights import WeightPublisher


class RayBackend:
    """``with RayBackend(config) as backend:`` Ray is up (or joined) inside, shut down (if started) after; the
    actors the backend made are killed on the way out whatever happened."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.session = RaySession(config)  # imports Ray, or one line naming the extra
        self.owned: list[Any] = []
        self.learners = None

    def __enter__(self) -> RayBackend:
        self.session.__enter__()
        from vcpo.orchestration.ray.weights import WeightBoard

        self.board = WeightBoard()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            for part in self.owned:
                part.close()
        finally:
            self.session.__exit__(*exc)

    def learner(self, model: torch.nn.Module, model_path: str):
        """The learner group (``trainer.num_learners`` ranks) mirrored by ``model`` in the driver."""
        from vcpo.orchestration.ray.learners import LearnerGroup

        group = LearnerGroup(model, self.config, model_path, self.board)
        self.owned.append(group)
        self.learners = group
        return group

    def source(self, model: torch.nn.Module, spec: WorkerSpec, start_version: int,
               publisher: WeightPublisher | None = None, sampling: DynamicSampling | None = None):
        """The rollout source over ``async.num_workers`` rollout actors; with ``publisher`` (inference servers) the
        driver publishes each version to the servers and the actors are their HTTP clients; ``sampling``: dynamic
        sampling (``rollout.filter``)."""
        from vcpo.orchestration.ray.rollout import RaySource

        ac, rc = self.config.async_, self.config.ray
        broadcast = None
        if rc.weight_sync == "broadcast" and publisher is None:
            from vcpo.orchestration.ray.broadcast import WeightBroadcast

            broadcast = WeightBroadcast(self.learners.actors[0], rc.timeout_s)
        source = RaySource(model, spec, ac.num_workers, ac.generation_bound(), ac.drop_older_than, start_version,
                           self.board, rc, publisher=publisher, broadcast=broadcast, sampling=sampling)
        self.owned.append(source)
        return source
