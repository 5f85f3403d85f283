"""task.reward for reasoning-gym generators: native, math-verify, and auto (math when every sampled answer is a
number); dataset files score by math-verify against the extracted reference."""

from __future__ import annotations

import json

import pytest

from vcpo.config import ConfigError, TaskConfig, load_config
from vcpo.tasks import ReasoningGymTask, TaskError, make_task


def test_auto_scores_numeric_generators_by_math_verify_and_others_natively():
    assert ReasoningGymTask("gsm_symbolic", reward="auto").scorer == "math"
    assert ReasoningGymTask("chain_sum", reward="auto").scorer == "math"
    assert ReasoningGymTask("spell_backward", reward="auto").scorer == "reasoning_gym"
    assert ReasoningGymTask("gsm_symbolic").scorer == "reasoning_gym"  # native by default: the demo scores as before
    with pytest.raises(TaskError, match="task.reward: 'exact' is not one of native, math, auto"):
        ReasoningGymTask("chain_sum", reward="exact")
    with pytest.raises(ConfigError, match="task.reward"):
        load_config(None, ["task.reward=exact"])


def test_gsm_symbolic_by_math_verify_reads_the_final_answer_of_a_reasoning_completion():
    task = make_task(TaskConfig(name="gsm_symbolic", kwargs={}, reward="math"))
    problems = task.problems("eval", 2, seed=0)
    answers = [int(p.answer) for p in problems]
    completions = [f"Let me think. First ... so the answer is \\boxed{{{answers[0]}}}.",
                   f"Step by step we get {answers[1] + 1}, which is wrong."]
    assert [o.reward for o in task.score(problems, completions)] == [1.0, 0.0]


def test_a_dataset_file_scores_equivalent_forms(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"problem": "half?", "solution": "It is $\\boxed{\\frac{1}{2}}$."}) + "\n")
    task = make_task(TaskConfig(name="jsonl", kwargs={"train_path": str(path), "eval_path": str(path)}))
    problem = task.problems("eval", 1, 0)[0]
    outcomes = task.score([problem] * 3, ["so 0.5", "\\boxed{2/4}", "#### 0.6"])
    assert [o.reward for o in outcomes] == [1.0, 1.0, 0.0]  # 1/2 = 0.5 = 2/4; 0.6 is not
