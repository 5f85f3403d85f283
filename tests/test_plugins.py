"""A user's own objective, task and reward by import path: the registry takes user objectives with their specs,
the config imports and checks every path when it loads (one line naming the key and the path), the working
directory is searched when nothing else holds the module, and a user's reward runs in the sandboxed pool."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from vcpo import objective_specs
from vcpo.config import ConfigError, load_config
from vcpo.objective_specs import HyperparameterError, Param
from vcpo.objectives import (
    ObjectiveOutput,
    get_objective,
    list_objectives,
    objective_hyperparameters,
    register,
    registry,
)
from vcpo.plugins import PluginError, is_import_path, load_object
from vcpo.rewards.pool import close_shared_pools
from vcpo.tasks import make_task
from vcpo.tasks.tool_task import TOOL_PREFIX
from vcpo.tasks.user_task import is_user_task
from vcpo.testing.faults import command_env

from conftest import make_inputs

OBJECTIVE = """
from vcpo.objectives import ObjectiveOutput, aggregate

def scaled(inp, *, loss_agg="token-mean", max_len=None, scale=2.0, tag="x"):
    return ObjectiveOutput(aggregate(-scale * inp.adv_BT * inp.logprobs, inp.mask, loss_agg, max_len), {"tag/len": 1.0})

def returns_a_tensor(inp, *, loss_agg="token-mean", max_len=None):
    return inp.logprobs.sum()
"""
REWARD = """
import time

def first_char(completion, answer):
    return float(completion[:1] == answer[:1])

def raises(completion, answer):
    raise RuntimeError("no")

def hangs(completion, answer):
    time.sleep(60)
    return 1.0
"""
TASK = """
from vcpo.types import Problem

class Echo:
    name = "echo"

    def __init__(self, word="ab"):
        self.word = word

    def problems(self, split, n, seed):
        return [Problem(uid=f"{split}/{seed}/{i}", prompt="say " + self.word + "\\n", answer=self.word)
                for i in range(n)]

    def reward(self, problem, completion):
        return float(completion.strip() == problem.answer)

class NoReward:
    def problems(self, split, n, seed):
        return []

def half_env(word="ab"):
    env = Echo(word)
    env.step = lambda *args: []
    return env
"""


@pytest.fixture
def registry_snapshot():
    """Registrations made by a test are undone after it (other tests iterate over every registered objective)."""
    saved = (dict(registry._REGISTRY), dict(registry._SCOPES), dict(objective_specs.OBJECTIVES),
             dict(objective_specs.ALIASES))
    yield
    for live, old in zip((registry._REGISTRY, registry._SCOPES, objective_specs.OBJECTIVES, objective_specs.ALIASES),
                         saved, strict=True):
        live.clear()
        live.update(old)


@pytest.fixture
def modules(tmp_path, monkeypatch, request):
    """Modules ``<test>_obj``, ``<test>_rew`` and ``<test>_task`` (names unique to the test) in a directory on
    ``sys.path``; returns their names."""
    stem = request.node.name.replace("[", "_").replace("]", "").replace("-", "_")
    names = {"obj": f"{stem}_obj", "rew": f"{stem}_rew", "task": f"{stem}_task"}
    for key, source in (("obj", OBJECTIVE), ("rew", REWARD), ("task", TASK)):
        (tmp_path / f"{names[key]}.py").write_text(source)
    monkeypatch.setattr(sys, "path", list(sys.path))  # what a failed import appends (the working directory) goes too
    monkeypatch.syspath_prepend(str(tmp_path))
    return names


def test_a_user_objective_registers_with_its_spec_and_is_checked_like_vcpos_own(registry_snapshot):
    @register("my_tis", params={"cap": Param(float, 2.0, low=1.0)})
    def my_tis(inp, *, loss_agg: str = "token-mean", max_len: int | None = None, cap: float = 2.0,
               level: str = "token"):
        weight_BT = torch.clamp(torch.exp(inp.behavior_log_ratio), max=cap)
        return ObjectiveOutput((-weight_BT * inp.adv_BT * inp.logprobs * inp.mask_f).sum() / inp.mask_f.sum())

    assert "my_tis" in list_objectives() and "my_tis" in objective_specs.objective_names()
    assert objective_hyperparameters("my_tis") == {"loss_agg": "token-mean", "max_len": None, "cap": 2.0,
                                                   "level": "token"}
    # lp - blp = ln 4 on the one token: the weight is capped at 2; loss = -2 * A * lp = -2 * 1 * ln 4.
    inp, _ = make_inputs([[torch.log(torch.tensor(4.0)).item()]], [[0.0]], [1.0])
    out = get_objective("my_tis")(inp, cap="2")
    assert float(out.loss.detach()) == pytest.approx(-2 * torch.log(torch.tensor(4.0)).item())
    assert "loss/value" in out.metrics and "is/token_ratio_max" in out.metrics  # the registry's shared diagnostics
    with pytest.raises(HyperparameterError, match="'cap' of objective 'my_tis': must be >= 1, got 0.5"):
        get_objective("my_tis")(inp, cap=0.5)
    with pytest.raises(HyperparameterError, match="'level' of objective 'my_tis': must be a string"):
        get_objective("my_tis")(inp, level=3)  # typed by its default, a str
    with pytest.raises(ValueError, match="already registered"):
        register("my_tis")(my_tis)


def test_register_needs_an_objective_signature_and_keeps_the_builtin_names(registry_snapshot):
    def no_agg(inp, *, cap=1.0):
        return None

    def a_flag(inp, *, loss_agg="token-mean", max_len=None, on=True):
        return None

    with pytest.raises(ValueError, match="needs the keyword-only hyperparameters loss_agg"):
        register("no_agg")(no_agg)
    with pytest.raises(ValueError, match="'on' defaults to True: give it a float, int or str default"):
        register("a_flag")(a_flag)
    with pytest.raises(ValueError, match="params names 'capp'"):
        register("typo", params={"capp": Param(float, 1.0)})(a_flag)
    with pytest.raises(ValueError, match="does not match vcpo.objective_specs"):
        register("ppo_clip", params={})(a_flag)
    assert "no_agg" not in list_objectives() and "typo" not in objective_specs.OBJECTIVES


def test_an_objective_by_import_path_loads_and_is_checked_in_the_config(modules, registry_snapshot):
    path = f"{modules['obj']}:scaled"
    cfg = load_config(None, [f"objective.name={path}", "objective.kwargs.scale=3"])
    assert cfg.objective.kwargs == {"scale": 3.0}  # typed by the signature's default (a float)
    assert objective_hyperparameters(path)["scale"] == 2.0 and registry.objective_scope(path) == "row"
    inp, _ = make_inputs([[-1.0]], [[-1.0]], [0.5])
    assert float(get_objective(path)(inp, scale=3.0).loss.detach()) == pytest.approx(1.5)  # -3 * 0.5 * -1
    for overrides, message in [
        ([f"objective.name={path}", "objective.kwargs.scale=abc"], "'objective.kwargs.scale' of objective"),
        ([f"objective.name={path}", "objective.kwargs.nope=1"], "'objective.kwargs.nope'"),
        ([f"objective.name={modules['obj']}:returns_a_tensor"], "returned Tensor, not an ObjectiveOutput"),
        ([f"objective.name={modules['obj']}:missing"], f"'{modules['obj']}' has no attribute 'missing'"),
        (["objective.name=no_such_module_anywhere:fn"], "no module named 'no_such_module_anywhere'"),
        (["objective.name=not a path"], "unknown objective 'not a path'"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(None, overrides)
        text = str(info.value)
        assert message in text and "objective" in text and "\n" not in text, text
    with pytest.raises(ConfigError, match=r"config key 'objective.name': no module named .*\(got 'no_such_module"):
        load_config(None, ["objective.name=no_such_module_anywhere:fn"])


def test_a_task_by_import_path_is_built_with_its_kwargs_and_checked_at_load(modules):
    path = f"{modules['task']}:Echo"
    cfg = load_config(None, [f"task.name={path}", "task.kwargs={word: xy}"])
    task = make_task(cfg.task)
    assert [p.prompt for p in task.problems("train", 2, seed=0)] == ["say xy\n"] * 2
    assert task.reward(task.problems("eval", 1, 0)[0], " xy") == 1.0
    for overrides, message in [
        ([f"task.name={path}", "task.kwargs={colour: 1}"], f"task.kwargs do not fit task '{path}' (it takes word)"),
        ([f"task.name={modules['task']}:NoReward", "task.kwargs={}"], "class NoReward has no reward method"),
        ([f"task.name={modules['task']}:Missing", "task.kwargs={}"], f"task.name '{modules['task']}:Missing'"),
        ([f"task.name={path}", "task.kwargs={}", f"task.reward={modules['rew']}:first_char"],
         "scores its own completions"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(None, overrides)
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    half = load_config(None, [f"task.name={modules['task']}:half_env", "task.kwargs={}"])
    with pytest.raises(ValueError, match="lacks max_turns, max_total_tokens, mask_void_turns, demonstration to be a "
                                         "multi-turn environment"):
        make_task(half.task)
    assert not is_user_task(TOOL_PREFIX + "chain_sum") and is_import_path(TOOL_PREFIX + "chain_sum")


def test_a_users_reward_scores_a_jsonl_dataset_in_the_sandboxed_pool(modules, tmp_path):
    tmp_path.chmod(0o755)  # run as root, the scorer drops to a uid of its own, which must read the module's directory
    # The process-wide scoring pool reads only what sys.path held when it started (as a trainer's does): another
    # test's pool would not see this test's module directory.
    close_shared_pools()
    data = tmp_path / "words.jsonl"
    data.write_text("".join(f'{{"prompt": "say {w}", "answer": "{w}"}}\n' for w in ("ab", "cd", "ef", "gh")))
    base = ["task.name=jsonl", f"task.kwargs.train_path={data}", f"task.kwargs.eval_path={data}",
            "task.reward_timeout_s=2"]
    task = make_task(load_config(None, [*base, f"task.reward={modules['rew']}:first_char"]).task)
    problems = task.problems("eval", 2, seed=0)  # answers ab, cd
    assert [(o.reward, o.status) for o in task.score(problems, ["a!", "x"])] == [(1.0, "ok"), (0.0, "ok")]
    raising = make_task(load_config(None, [*base, f"task.reward={modules['rew']}:raises"]).task)
    assert [o.status for o in raising.score(problems, ["a", "c"])] == ["error", "error"]
    hanging = make_task(load_config(None, [*base, f"task.reward={modules['rew']}:hangs"]).task)
    assert [(o.reward, o.status) for o in hanging.score(problems[:1], ["a"])] == [(0.0, "timeout")]
    for reward, message in [("first_char", "must be native, math, auto, or an import path"),
                            (f"{modules['rew']}:time", "is module"),
                            ("json:loads", "must accept (completion, answer)")]:  # json.loads(s, *, ...)
        with pytest.raises(ConfigError, match=r"config key 'task.reward'") as info:
            load_config(None, [*base, f"task.reward={reward}"])
        assert message in str(info.value), str(info.value)


def test_an_unimportable_module_is_searched_for_in_the_working_directory(tmp_path):
    """As `vcpo` runs from its console script: the working directory is not on sys.path (python -P), yet a module
    there is found, and only when nothing else holds it."""
    (tmp_path / "cwd_objective.py").write_text(OBJECTIVE)
    code = textwrap.dedent("""
        import os, sys
        from vcpo.config import load_config
        assert os.getcwd() not in sys.path
        cfg = load_config(None, ["objective.name=cwd_objective:scaled"])
        print(sys.path[-1] == os.getcwd(), cfg.objective.name)
    """)
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env=command_env(), timeout=120)
    assert proc.stdout.split() == ["True", "cwd_objective:scaled"], proc.stderr[-2000:]


def test_load_object_says_what_is_wrong_with_a_path(monkeypatch, tmp_path):
    (tmp_path / "broken_plugin.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for path, reason in [("a.b", "is not an import path of the form module.sub:name"),
                         ("broken_plugin:x", "importing 'broken_plugin' failed: ModuleNotFoundError: No module named "
                                             "'no_such_dependency_here'"),
                         ("json:nope.deeper", "'json' has no attribute 'nope'")]:
        with pytest.raises(PluginError) as info:
            load_object(path)
        assert info.value.reason == reason and info.value.path == path
    assert load_object("json:decoder.JSONDecoder").__name__ == "JSONDecoder"
