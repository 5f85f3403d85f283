"""Helpers for checking vcpo from the outside (tests and benchmarks): processes, shared memory, fault injection."""
