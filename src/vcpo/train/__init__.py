"""Training: the loop (trainer), the learner step, checkpoints and the supervised warm start."""
