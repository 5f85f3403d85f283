"""Validating everything before work starts: objective hyperparameters typed and range-checked from one
torch-free spec (held equal to the registered functions' signatures), YAML errors with line and column,
and config errors found before torch, transformers or reasoning-gym is imported."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

from vcpo.config import ConfigError, load_config
from vcpo.objective_specs import ALIASES, OBJECTIVES, HyperparameterError, check_hyperparameters, objective_names
from vcpo.objectives import get_objective, list_objectives
from vcpo.objectives.registry import _REGISTRY

from conftest import make_inputs


def test_specs_match_every_registered_signature():
    assert objective_names() == list_objectives()
    for name in list_objectives():
        params = inspect.signature(_REGISTRY[name]).parameters.values()
        signature = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
        spec = OBJECTIVES[ALIASES.get(name, name)]
        assert signature == {k: p.default for k, p in spec.items()}, name


def test_strings_are_coerced_where_the_spec_says_number():
    # YAML 1.1 reads 1e3 as the string "1e3"; the spec says float, so it becomes 1000.0.
    assert check_hyperparameters("tis", {"cap": "1e3", "level": "sequence"}) == {"cap": 1000.0, "level": "sequence"}
    assert check_hyperparameters("vcpo", {"max_len": "8", "loss_agg": "seq-mean-token-sum-norm"})["max_len"] == 8
    cfg = load_config(None, ["objective.name=tis", "objective.kwargs.cap=1e3"])
    assert cfg.objective.kwargs == {"cap": 1000.0}


@pytest.mark.parametrize(("given", "culprit", "reason"), [
    ({"cap": -5}, "cap", "must be >= 1, got -5"),
    ({"cap": True}, "cap", "must be a number"),
    ({"cap": "abc"}, "cap", "must be a number"),
    ({"level": "geometric"}, "level", "must be one of token, sequence"),
    ({"capp": 3}, "capp", "unknown hyperparameter"),
    ({"loss_agg": "bogus"}, "loss_agg", "must be one of token-mean"),
    ({"loss_agg": "seq-mean-token-sum-norm"}, "max_len", "needs max_len"),
    ({"max_len": 2.5}, "max_len", "must be an integer"),
])
def test_bad_hyperparameters_name_the_culprit(given, culprit, reason):
    with pytest.raises(HyperparameterError) as info:
        check_hyperparameters("tis", given)
    assert info.value.name == culprit and reason in info.value.reason


def test_a_bound_may_name_another_hyperparameter():
    # BAPO: c_low_max must be >= c_low (default 0.6); with c_low = 0.4 the same 0.5 is fine.
    with pytest.raises(HyperparameterError, match=r"c_low_max.*>= c_low=0.6, got 0.5"):
        check_hyperparameters("bapo", {"c_low_max": 0.5})
    assert check_hyperparameters("bapo", {"c_low": 0.4, "c_low_max": 0.5}) == {"c_low": 0.4, "c_low_max": 0.5}


def test_the_registered_function_checks_and_coerces_its_arguments():
    inp, _ = make_inputs([[0.0]], [[0.0]], [1.0])
    out = get_objective("tis")(inp, cap="4")  # lp = blp: weight 1 = min(1, 4), loss = -A * lp = 0
    assert float(out.loss.detach()) == 0.0
    with pytest.raises(ValueError, match="'cap'"):
        get_objective("tis")(inp, cap=-5.0)


@pytest.mark.parametrize(("overrides", "named"), [
    (["objective.name=tis", "objective.kwargs.cap=-5"], "'objective.kwargs.cap' of objective 'tis': must be >= 1"),
    (["objective.loss_agg=bogus"], "'objective.loss_agg'"),
    (["objective.loss_agg=seq-mean-token-sum-norm"], "'objective.max_len'"),
    (["objective.max_len=8"], "used only by objective.loss_agg=seq-mean-token-sum-norm"),
    (["objective.kwargs.max_len=8"], "set it as objective.max_len"),
    (["objective.kwargs.loss_agg=token-mean"], "set it as objective.loss_agg"),
    # The hyperparameters added with the replay work: BAPO's separate steps, M2PO's behavior weight, MIS's weight.
    (["objective.name=bapo", "objective.kwargs.step=0.1", "objective.kwargs.step_high=0.2"],
     "'objective.kwargs.step' of objective 'bapo': sets step_low and step_high at once"),
    (["objective.name=bapo", "objective.kwargs.step_low=0"],
     "'objective.kwargs.step_low' of objective 'bapo': must be > 0"),
    (["objective.name=m2po", "objective.kwargs.behavior_weight_max=0.5"], "must be >= 1, got 0.5"),
    (["objective.name=mis", "objective.kwargs.weight=both"], "must be one of ratio, unit"),
])
def test_config_errors_name_the_key(overrides, named):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_dr_grpo_aggregation_is_usable_from_the_config():
    cfg = load_config(None, ["objective.loss_agg=seq-mean-token-sum-norm", "objective.max_len=8"])
    assert (cfg.objective.loss_agg, cfg.objective.max_len) == ("seq-mean-token-sum-norm", 8)


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("seed: 0\ntrainer:\n  lr: 1e-4\n   max_steps: 3\n")  # line 4 is indented deeper than lr
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and "line 4, column 13" in message and "\n" not in message


def test_config_errors_come_before_any_heavy_import():
    code = ("import sys\nsys.argv = ['vcpo', 'train', 'trainer.lr=-1']\nfrom vcpo.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
            "heavy = [m for m in ('torch', 'transformers', 'reasoning_gym') if m in sys.modules]\n"
            "print(code, heavy)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.stdout.strip() == "2 []", proc.stdout + proc.stderr
    assert proc.stderr.strip() == "error: config key 'trainer.lr': Input should be greater than 0 (got -1)"
