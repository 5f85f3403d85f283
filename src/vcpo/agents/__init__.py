"""Agents written for the OpenAI API as vcpo tasks (``task.name: agent:<module>:<function>``): an OpenAI-compatible
endpoint in front of the run's rollout engine that records exactly what the policy sampled, a runner process for the
agent code, and the collector that turns recorded calls into trajectories (docs/agents.md)."""
