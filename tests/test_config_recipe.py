"""``recipe``: the stable default (VESPO with VCPO's controls), the paper's VCPO one key away, keys the config sets
always win, and a run saved before recipes existed resumes and reruns with the defaults of its time."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vcpo.config import ConfigError, load_config, load_run_config, save_config
from vcpo.config.recipe import RECIPES

ROOT = Path(__file__).resolve().parents[1]


def method(config) -> dict:
    return {"objective.name": config.objective.name, "advantage.estimator": config.advantage.estimator,
            "advantage.opob_variant": config.advantage.opob_variant,
            "advantage.grad_norm_method": config.advantage.grad_norm_method,
            "trainer.ess_lr.enabled": config.trainer.ess_lr.enabled}


def test_the_default_is_the_stable_recipe():
    config = load_config(None)
    assert config.recipe == "stable"
    assert method(config) == {"objective.name": "vespo", "advantage.estimator": "opob",
                              "advantage.opob_variant": "grad_only", "advantage.grad_norm_method": "logit_proxy",
                              "trainer.ess_lr.enabled": True}


def test_the_paper_is_one_key_away():
    assert method(load_config(None, ["recipe=paper"])) == {
        "objective.name": "vcpo", "advantage.estimator": "opob", "advantage.opob_variant": "plugin",
        "advantage.grad_norm_method": "fast", "trainer.ess_lr.enabled": True}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_keys_the_config_sets_win_over_the_recipe(recipe, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"recipe": recipe, "objective": {"name": "grpo"},
                                    "advantage": {"opob_variant": "leave_one_out"}}))
    config = load_config(path, ["trainer.ess_lr.enabled=false"])
    assert (config.objective.name, config.advantage.opob_variant, config.trainer.ess_lr.enabled) == (
        "grpo", "leave_one_out", False)
    # the keys left out still come from the recipe
    assert config.advantage.grad_norm_method == RECIPES[recipe]["advantage.grad_norm_method"]


def test_an_unknown_recipe_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"^config key 'recipe'.*'stable' or 'paper'.*'fast'"):
        load_config(None, ["recipe=fast"])


def test_the_file_kwargs_stay_when_the_name_override_equals_the_recipe_name(tmp_path, caplog):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"recipe": "paper", "objective": {"kwargs": {"cap": 4.0}}}))
    assert load_config(path, ["objective.name=vcpo"]).objective.kwargs == {"cap": 4.0}
    assert "replaces" not in caplog.text


def test_a_saved_run_reloads_to_the_same_config_under_either_loader(tmp_path):
    for recipe in RECIPES:
        config = load_config(None, [f"recipe={recipe}", "objective.name=grpo"])
        save_config(config, tmp_path / f"{recipe}.yaml")
        assert load_config(tmp_path / f"{recipe}.yaml") == config
        assert load_run_config(tmp_path / f"{recipe}.yaml") == config


def test_a_run_saved_before_recipes_gets_the_defaults_it_ran_with():
    # A committed study cell of the paper's VCPO, written when the config had no recipe and no opob_variant key
    # (the default then: plugin). Resumed or rerun it must stay the paper's estimator, not become grad_only.
    cell = ROOT / "benchmarks/staleness/study2/cells/vcpo_k16_w0_s0/config.yaml"
    saved = yaml.safe_load(cell.read_text())
    assert "recipe" not in saved and "opob_variant" not in saved["advantage"]
    config = load_run_config(cell)
    assert (config.recipe, config.objective.name, config.advantage.opob_variant,
            config.advantage.grad_norm_method) == ("paper", "vcpo", "plugin", "fast")
    assert load_config(cell).advantage.opob_variant == "grad_only"  # as a user's file, it is today's default


def test_the_study_configs_pin_the_paper_recipe_their_vcpo_arms_ran_with():
    # configs the committed grids start from: their `vcpo` arm sets no opob_variant and ran with plugin
    for name in ("staleness_study", "tools", "heldout_decimals"):
        config = load_config(ROOT / "configs" / f"{name}.yaml", ["objective.name=vcpo", "advantage.estimator=opob"])
        assert config.advantage.opob_variant == "plugin", name


def test_config_show_gives_each_key_the_default_of_the_config_s_recipe():
    from vcpo.config_reference import show

    lines = show(load_config(None, ["recipe=paper", "advantage.opob_variant=grad_only"]), "x").splitlines()
    assert "recipe: paper  * default stable" in lines
    assert "objective.name: vcpo  (default)" in lines  # the paper recipe's default, not stable's vespo
    assert "advantage.opob_variant: grad_only  * default plugin" in lines
    assert "advantage.opob_variant: grad_only  (default)" in show(load_config(None), "x").splitlines()
