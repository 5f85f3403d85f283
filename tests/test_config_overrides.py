"""Dotted overrides on top of a config file: a dict-valued key is replaced whole, a section is merged, and changing
task.name or objective.name drops the kwargs the file wrote for the old one (issue 23 item 6)."""

from __future__ import annotations

import pytest
import yaml

from vcpo.config import ConfigError, load_config

from conftest import ROOT, vcpo

QUICKSTART = ROOT / "configs" / "quickstart.yaml"


@pytest.fixture
def sums(tmp_path):
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(f'{{"question": "{i} + 1 = ?", "answer": "#### {i + 1}"}}\n' for i in range(10)))
    return path


@pytest.mark.parametrize("order", ["name first", "kwargs first"])
def test_changing_task_name_drops_the_files_kwargs_in_any_order(sums, order):
    overrides = ["task.name=jsonl", f"task.kwargs.path={sums}"]
    if order == "kwargs first":
        overrides.reverse()
    task = load_config(QUICKSTART, overrides).task
    assert (task.name, task.kwargs) == ("jsonl", {"path": str(sums)})  # no min_terms from the quickstart
    assert task.eval_size == 500  # the rest of the file's task section stays


def test_dropping_the_files_kwargs_is_said_in_one_line_naming_them(sums, caplog):
    with caplog.at_level("WARNING", logger="vcpo.config"):
        load_config(QUICKSTART, ["task.name=jsonl", f"task.kwargs.path={sums}"])
    assert [r.getMessage() for r in caplog.records] == [
        "note: task.name=jsonl replaces chain_sum, so the file's task.kwargs (min_terms, max_terms, min_digits, "
        "max_digits) are dropped; give the new one its own as task.kwargs.KEY=VALUE"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="vcpo.config"):
        load_config(QUICKSTART, ["task.name=chain_sum", "trainer.lr=1e-4"])  # same name: nothing dropped
        load_config(None, ["task.name=products"])  # no file kwargs to drop
    assert caplog.records == []


def test_a_task_named_without_kwargs_gets_none_and_one_error_says_what_it_needs():
    assert load_config(QUICKSTART, ["task.name=products"]).task.kwargs == {}
    with pytest.raises(ConfigError, match=r"^task 'jsonl' needs task.kwargs.path"):
        load_config(QUICKSTART, ["task.name=jsonl"])


def test_the_same_task_name_keeps_the_files_kwargs_and_a_leaf_override_merges_into_them():
    kwargs = load_config(QUICKSTART, ["task.name=chain_sum", "task.kwargs.min_terms=3"]).task.kwargs
    assert kwargs == {"min_terms": 3, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def test_a_dict_valued_key_is_replaced_whole():
    assert load_config(QUICKSTART, ["task.kwargs={min_terms: 3, max_terms: 4}"]).task.kwargs == {
        "min_terms": 3, "max_terms": 4}


def test_a_mapping_for_a_section_merges_into_the_files_section():
    trainer = load_config(QUICKSTART, ["trainer={lr: 1e-3, ess_lr: {rule: linear}}"]).trainer
    assert (trainer.lr, trainer.max_steps, trainer.eval_every) == (1e-3, 200, 20)  # max_steps, eval_every from file
    assert (trainer.ess_lr.rule, trainer.ess_lr.enabled) == ("linear", True)


def test_changing_objective_name_drops_the_files_objective_kwargs(tmp_path):
    path = tmp_path / "tis.yaml"
    path.write_text(yaml.safe_dump({"objective": {"name": "tis", "kwargs": {"level": "sequence", "cap": 4}}}))
    assert load_config(path, ["objective.name=vespo"]).objective.kwargs == {}
    assert load_config(path, ["objective.kwargs.cap=2"]).objective.kwargs == {"level": "sequence", "cap": 2}
    # without the drop, vespo would have been handed tis's `level`
    assert load_config(path, ["objective.name=vespo", "objective.kwargs.k_pos=3"]).objective.kwargs == {"k_pos": 3}


def test_the_command_line_applies_the_same_rules(sums):
    proc = vcpo("config", "show", "-c", "configs/quickstart.yaml", "task.name=jsonl", f"task.kwargs.path={sums}")
    assert f"task.kwargs: {{path: {sums}}}  * default {{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}}" \
        in proc.stdout.splitlines()
    assert proc.stderr.startswith("note: task.name=jsonl replaces chain_sum, so the file's task.kwargs (min_terms")
    bad = vcpo("config", "show", "-c", "configs/quickstart.yaml", f"task.kwargs.path={sums}", "task.kwargs.x=1",
               "task.name=jsonl", check=False)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: task.kwargs.x: not a setting of task 'jsonl'") and bad.stderr.count("\n") == 1
