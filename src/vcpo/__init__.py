"""vcpo: stable asynchronous reinforcement learning for large language models.

The objective library lives in :mod:`vcpo.objectives`, the variance controls (ESS, ESS-scaled
learning rate, the off-policy optimal baseline) in :mod:`vcpo.variance`.
"""

__version__ = "0.1.0"
