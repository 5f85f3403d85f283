"""Adapters from other trainers to vcpo's objectives and variance controls: ``vcpo.integrations.trl`` (TRL's
GRPOTrainer) and ``vcpo.integrations.verl`` (verl's policy-loss registry). Each imports its framework; nothing else
in vcpo imports them."""
