"""The config reference: `vcpo config show`, docs/config.md generated from the models' field docs, and the
built-in defaults being configs/quickstart.yaml."""

from __future__ import annotations

from vcpo.config import Config, load_config
from vcpo.config_reference import BEGIN, END, format_value, reference, render_docs

from conftest import ROOT, vcpo


def _leaves(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        if isinstance(value, dict) and key != "kwargs" and not key.endswith("_resources"):  # mapping-valued keys
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out


def test_every_key_is_in_the_reference_once_with_a_description():
    _, keys = reference()
    names = [k.dotted for k in keys]
    assert len(names) == len(set(names))
    assert set(names) == _leaves(Config().to_dict())
    assert {"seed", "run_dir", "objective.name", "trainer.max_steps", "trainer.lr", "async.mode",
            "async.max_staleness", "task.kwargs"} <= set(names)
    undocumented = [k.dotted for k in keys if len(k.description) < 10]
    assert not undocumented, f"config keys without a docstring under their field: {undocumented}"


def test_docs_config_md_is_generated_from_the_models():
    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert render_docs(text) == text, "docs/config.md is stale: run `vcpo config docs` and commit it"
    generated = text.split(BEGIN)[1].split(END)[0]
    assert "| `trainer.max_steps` | int, > 0 | `200` | Optimizer steps of the run" in generated
    assert "| `async.mode` | one of: sync, lagged, async | `async` |" in generated


def test_a_stale_reference_is_rewritten(tmp_path):
    doc = tmp_path / "config.md"
    doc.write_text(f"# prose kept\n{BEGIN}\n| `trainer.lr` | old |\n{END}\ntail kept\n")
    vcpo("config", "docs", "--out", str(doc))
    text = doc.read_text()
    assert text.startswith("# prose kept\n") and text.endswith("tail kept\n") and "| old |" not in text
    assert render_docs(text) == text


def test_the_built_in_defaults_are_the_quickstart():
    """`vcpo train` without -c must run what the README's command runs (issue 23: 60 vs 200 steps, 200 vs 500
    evaluation problems)."""
    assert load_config(ROOT / "configs" / "quickstart.yaml").to_dict() == load_config(None).to_dict()


def test_config_show_prints_value_default_and_description_of_every_key():
    proc = vcpo("config", "show", "-c", "configs/tools.yaml", "trainer.lr=0.5")
    lines = proc.stdout.splitlines()
    assert "trainer.lr: 0.5  * default 0.0001" in lines
    assert "task.eval_size: 200  * default 500" in lines
    assert "trainer.max_steps: 60  * default 200" in lines
    assert "seed: 0  (default)" in lines
    i = lines.index("trainer.lr: 0.5  * default 0.0001")
    assert lines[i + 1].startswith("    AdamW learning rate")
    _, keys = reference()
    shown = {line.split(":")[0] for line in lines if line and not line.startswith((" ", "#"))}
    assert shown == {k.dotted for k in keys}
    assert proc.stderr == ""


def test_config_show_without_a_file_is_the_defaults_and_a_bad_key_is_one_line():
    proc = vcpo("config", "show")
    assert "trainer.max_steps: 200  (default)" in proc.stdout.splitlines()
    bad = vcpo("config", "show", "trainer.nope=1", check=False)
    assert bad.returncode == 2 and bad.stderr == "error: unknown config key 'trainer.nope'\n"


def test_values_are_shown_as_yaml_would_write_them():
    assert [format_value(v) for v in (None, True, 1e-4, 0.002, 200, "runs/x", {"a": 1}, [0.9, 0.999], "")] == [
        "null", "true", "0.0001", "0.002", "200", "runs/x", "{a: 1}", "[0.9, 0.999]", "''"]

