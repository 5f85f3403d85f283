"""The Ray backend (``async.backend: ray``, docs/ray.md): rollout actors, a data-parallel learner group and
versioned weight sync through the object store, behind the same ``RolloutSource`` and learner interfaces as the
local backend. Imported only when chosen: ``RayBackend`` imports Ray itself, with a one-line error if missing."""

from vcpo.orchestration.ray.backend import RayBackend

__all__ = ["RayBackend"]
