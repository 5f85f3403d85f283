"""The training loop (``vcpo train``): it drives the rollout sources (vcpo.orchestration) and the learner
(vcpo.train), watches each step with the health alarms, and checkpoints, so it sits above both."""
