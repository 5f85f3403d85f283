"""Rewards: math-verify equivalence (``math_reward``) and the sandboxed scoring pool every task reward runs in."""

from vcpo.rewards.math import math_reward, math_rewards
from vcpo.rewards.pool import RewardOutcome, RewardPoolError, ScoreRequest, ScoringPool, shared_pool

__all__ = ["RewardOutcome", "RewardPoolError", "ScoreRequest", "ScoringPool", "math_reward", "math_rewards",
           "shared_pool"]
