"""Evaluation: the unbiased pass@k estimator by hand, mean@N / pass@N aggregation, and the whole path on a tiny
model where the answers are known (near-zero top-p samples are the greedy completion)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vcpo.models.default import build_default_model
from vcpo.models.loading import load_policy
from vcpo.tasks import ReasoningGymTask
from vcpo.train.evaluate import EvalSettings, at_k_metrics, evaluate, greedy_completions, pass_at_k
from vcpo.types import Problem


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # pass@1 = c/n
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0  # k = n: any correct sample
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # C(7,5) = 21, C(10,5) = 252
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


@given(st.integers(1, 30).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_pass_at_k_grows_with_k_from_c_over_n(nc):
    n, c = nc
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert values[0] == pytest.approx(c / n)
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(values))


def test_at_k_metrics_by_hand():
    rows = [[True, False, False, False], [True, True, False, False], [False, False, False, False]]
    metrics = at_k_metrics(rows, 4)
    assert metrics["mean@4"] == pytest.approx(3 / 12)  # 3 correct samples of 12
    assert metrics["pass@4"] == pytest.approx(2 / 3)  # problems 1 and 2 have a correct sample, problem 3 none


class ExactMatch:
    """A trusted task of the test's own: reward 1.0 when the completion equals the problem's answer."""

    name = "exact"

    def reward(self, problem: Problem, completion: str) -> float:
        return float(completion == problem.answer)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    task = ReasoningGymTask("chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    path = build_default_model(task, seed=0, out_dir=tmp_path_factory.mktemp("m"))
    model, tokenizer = load_policy(path)
    return model, tokenizer, task.problems("eval", 6, seed=0)


def test_samples_at_vanishing_top_p_are_greedy_so_every_metric_is_known(tiny):
    model, tokenizer, problems = tiny
    greedy = greedy_completions(model, tokenizer, problems, max_new_tokens=3)
    # the first 4 answers are what the model says greedily, the last 2 can never match (longer than 3 tokens)
    rigged = [Problem(p.uid, p.prompt, g) for p, g in zip(problems[:4], greedy[:4], strict=True)]
    rigged += [Problem(p.uid, p.prompt, "never") for p in problems[4:]]
    settings = EvalSettings(max_new_tokens=3, samples=5, temperature=1.0, top_p=1e-6, batch_size=4)
    metrics = evaluate(model, tokenizer, ExactMatch(), rigged, settings)
    assert metrics == pytest.approx({"eval/accuracy": 4 / 6, "eval/mean@5": 4 / 6, "eval/pass@5": 4 / 6})


def test_sampled_metrics_are_seeded_and_pass_is_at_least_mean(tiny):
    model, tokenizer, problems = tiny

    class FirstCharIsDigit(ExactMatch):
        def reward(self, problem: Problem, completion: str) -> float:
            return float(completion[:1].isdigit())

    settings = EvalSettings(max_new_tokens=2, samples=4, temperature=1.0, top_p=1.0, seed=3)
    first = evaluate(model, tokenizer, FirstCharIsDigit(), problems, settings)
    assert first == evaluate(model, tokenizer, FirstCharIsDigit(), problems, settings)
    assert 0.0 <= first["eval/mean@4"] <= first["eval/pass@4"] <= 1.0
    assert set(first) == {"eval/accuracy", "eval/mean@4", "eval/pass@4"}
    greedy_only = evaluate(model, tokenizer, ExactMatch(), problems, EvalSettings(max_new_tokens=2))
    assert greedy_only.keys() == {"eval/accuracy"}


def test_the_eval_table_shows_a_multi_turn_task_without_sampled_columns(tmp_path):
    """A multi-turn task is evaluated on greedy episodes only (no mean@N / pass@N): `vcpo eval` printed its table
    with a KeyError ('mean@8') after evaluating; the columns it lacks now show '-'."""
    from io import StringIO

    from rich.console import Console

    from vcpo.train.eval_report import write_report

    report = {"model": "m", "samples": 8, "temperature": 0.8, "top_p": 0.7, "datasets": {
        "tools:products": {"problems": 4, "accuracy": 0.5, "time_s": 1.0},
        "chain_sum": {"problems": 4, "accuracy": 0.25, "mean@8": 0.375, "pass@8": 0.75, "time_s": 1.0}}}
    console = Console(file=StringIO(), width=200)
    write_report(report, tmp_path / "eval.json", console)
    text = console.file.getvalue()
    assert "tools:products" in text and "0.500" in text and "0.375" in text and "0.750" in text
    rows = [line for line in text.splitlines() if "tools:products" in line]
    assert rows and rows[0].count("-") >= 2
