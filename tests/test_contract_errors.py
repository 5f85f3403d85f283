"""Errors a user can cause: unknown names, unknown or out-of-range hyperparameters, bad shapes."""

from __future__ import annotations

import pytest
import torch

from vcpo.objectives import ObjectiveInputs, get_objective, list_objectives

from conftest import make_inputs


def test_unknown_objective_lists_valid_names():
    with pytest.raises(ValueError, match="valid names:.*reinforce"):
        get_objective("no-such-objective")


def test_unknown_hyperparameter_is_named():
    inp, _ = make_inputs([[0.0]], [[0.0]], [1.0])
    with pytest.raises(ValueError, match="'eps_lo'"):
        get_objective("ppo_clip")(inp, eps_lo=0.1)


def test_out_of_range_hyperparameter_is_named():
    inp, _ = make_inputs([[0.0]], [[0.0]], [1.0])
    with pytest.raises(ValueError, match="eps_low"):
        get_objective("ppo_clip")(inp, eps_low=1.5)
    with pytest.raises(ValueError, match="dual_clip"):
        get_objective("ppo_clip")(inp, dual_clip=0.5)


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("behavior_logprobs", torch.zeros(2, 4), "behavior_logprobs.*2x4"),
        ("mask", torch.ones(3, 3), "mask.*3x3"),
        ("advantages", torch.zeros(3), "advantages.*3"),
        ("rewards", torch.zeros(5), "rewards.*5"),
        ("group_ids", torch.zeros(3, dtype=torch.long), "group_ids.*3"),
        ("old_logprobs", torch.zeros(3, 2), "old_logprobs.*3x2"),
    ],
)
def test_shape_mismatch_names_tensor(field, value, pattern):
    kwargs = dict(logprobs=torch.zeros(2, 3), behavior_logprobs=torch.zeros(2, 3),
                  advantages=torch.zeros(2), mask=torch.ones(2, 3))
    kwargs[field] = value
    with pytest.raises(ValueError, match=pattern):
        ObjectiveInputs(**kwargs)


def test_dtype_mismatch_named():
    with pytest.raises(ValueError, match="group_ids"):
        ObjectiveInputs(logprobs=torch.zeros(2, 3), behavior_logprobs=torch.zeros(2, 3),
                        advantages=torch.zeros(2), mask=torch.ones(2, 3), group_ids=torch.zeros(2))


def test_list_objectives_sorted():
    names = list_objectives()
    assert names == sorted(names) and "grpo" in names and "ppo_clip" in names
