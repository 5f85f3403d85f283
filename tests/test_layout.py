"""The package's layout says the flow (STYLE: imports point downward): the pure objectives and variance controls know
nothing of training; the learner (vcpo/train) knows nothing of where batches come from; the rollout sources
(vcpo/orchestration) feed a learner but know nothing of the loop; the loop (vcpo/loop) drives both and knows nothing
of the studies run on top of it; the adapters to other trainers (vcpo/integrations) are imported by nothing in vcpo.
Every import counts, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT

SRC = ROOT / "src" / "vcpo"

FORBIDDEN = {
    "objectives": {"train", "loop", "orchestration", "rollout", "study", "agents", "serve", "envs", "tasks", "cli"},
    "variance": {"train", "loop", "orchestration", "rollout", "study", "agents", "serve", "envs", "tasks", "cli"},
    "train": {"loop", "orchestration", "study", "cli"},
    "orchestration": {"loop", "study", "cli"},
    "loop": {"study", "cli"},
}
"""Package -> the vcpo packages none of its modules may import."""


def _package(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def vcpo_imports(path: Path) -> set[str]:
    """The top-level vcpo packages (or modules) a file imports anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        found |= {name.split(".")[1] for name in names if name.startswith("vcpo.")}
    return found


MODULES = sorted(SRC.rglob("*.py"))


def test_the_walker_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import vcpo.variance\ndef f():\n    from vcpo.loop.trainer import train\n"
                      "    import vcpo.train.learner as learner\nfrom . import sibling\n")
    assert vcpo_imports(module) == {"variance", "loop", "train"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_downward(package):
    wrong = {f"{path.relative_to(SRC)} imports vcpo.{name}"
             for path in MODULES if _package(path) == package for name in vcpo_imports(path) & FORBIDDEN[package]}
    assert not wrong, sorted(wrong)


def test_nothing_in_vcpo_imports_the_integrations():
    wrong = [str(path.relative_to(SRC)) for path in MODULES
             if _package(path) != "integrations" and "integrations" in vcpo_imports(path)]
    assert not wrong
