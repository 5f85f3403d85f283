"""Rollout: turning prompts into responses with per-token behavior log-probs and policy versions."""

from vcpo.rollout.engine import (
    HFRolloutEngine,
    RolloutEngine,
    RolloutError,
    WeightLoadError,
    WeightPoll,
    sample_next,
)

__all__ = ["HFRolloutEngine", "RolloutEngine", "RolloutError", "WeightLoadError", "WeightPoll", "sample_next"]
