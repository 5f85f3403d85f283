"""Where batches come from: synchronous, deterministically lagged, or truly asynchronous rollouts.

Each mode is a ``RolloutSource``; the training loop only calls ``next_batch`` and ``publish``.
"""

from vcpo.orchestration.base import ProblemStream, RolloutContext, RolloutSource
from vcpo.orchestration.local import LaggedSource, SyncSource

__all__ = ["LaggedSource", "ProblemStream", "RolloutContext", "RolloutSource", "SyncSource"]
