"""Environments the model acts in: the sandbox that runs untrusted code (``vcpo.envs.sandbox``)."""
