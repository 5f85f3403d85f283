"""The SimpleTIR tool format and the tool task: parsing turns, what the model is shown, the environment's answers
(code run in the real sandbox), the reward, SFT demonstrations masked to the model's turns, and settings errors."""

from __future__ import annotations

import pytest

from vcpo.config import TaskConfig
from vcpo.envs.sandbox import SandboxResult
from vcpo.envs.simpletir import cut_middle, observation_text, parse_turn, tool_output
from vcpo.models.default import BASE_CHARACTERS, build_char_tokenizer
from vcpo.tasks import TaskError, make_task
from vcpo.train.sft import IGNORE_INDEX, _teacher_forcing_batch
from vcpo.types import Problem

KWARGS = {"min_terms": 2, "max_terms": 2, "min_digits": 4, "max_digits": 4}


@pytest.fixture(scope="module")
def task():
    return make_task(TaskConfig(name="tools:products", kwargs={**KWARGS, "tool_workers": 2}))


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(BASE_CHARACTERS)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(("text", "code", "answer", "void"), [
    ("```python\nprint(2*3)\n```", "print(2*3)", None, False),
    ("```py\nx = 1\nprint(x)\n```", "x = 1\nprint(x)", None, False),
    ("```\nprint(1)\n```", "print(1)", None, False),  # a bare fence counts, as in SimpleTIR's regex
    ("first ```python\na\n``` then ```python\nb\n```", "a", None, False),  # the first block only
    ("```python\nprint(1)", None, None, True),  # unclosed: no call
    ("so \\boxed{42}.", None, "42", False),
    ("\\boxed{4", None, None, False),  # the mark ends the episode even unbalanced; nothing to score
    ("just words", None, None, True),
])
def test_parse_turn(text, code, answer, void):
    parsed = parse_turn(text)
    assert (parsed.code, parsed.answer, parsed.void) == (code, answer, void)


def test_tool_output_shows_stdout_or_the_last_error_line_cut_in_the_middle():
    ok = SandboxResult(stdout="15179649\n", stderr="", exit_code=0, timed_out=False, duration_s=0.1)
    assert tool_output(ok) == ("15179649", False)
    err = SandboxResult(stdout="partial\n", stderr="Traceback (most recent call last):\n  File x\nNameError: y\n",
                        exit_code=1, timed_out=False, duration_s=0.1)
    assert tool_output(err) == ("NameError: y", True)
    hung = SandboxResult(stdout="", stderr="", exit_code=None, timed_out=True, duration_s=5.0)
    assert tool_output(hung)[1] is True
    cut = cut_middle("x" * 600)  # 256 head + note + 256 tail
    assert cut.startswith("x" * 256 + "\n...") and cut.endswith("...\n" + "x" * 256)
    assert observation_text("6") == "\nCode execution result: 6\n"


def test_step_runs_code_in_the_sandbox_scores_answers_and_ends_void_turns(task, tokenizer):
    problems = task.problems("train", 5, seed=0)
    p = problems[0]
    turns = [
        f"```python\nprint({p.metadata['entry']['metadata']['expression']})\n```",
        "```python\nprint(1/0)\n```",
        f"\\boxed{{{problems[2].answer}}}",
        "\\boxed{123}",
        "no code, no answer",
    ]
    steps = task.step(tokenizer, problems, [ids(tokenizer, t) for t in turns], 0)
    assert tokenizer.decode(steps[0].observation_ids) == f"\nCode execution result: {p.answer}\n"
    assert (steps[0].done, steps[0].tool_calls, steps[0].tool_errors) == (False, 1, 0)
    error = "ZeroDivisionError: division by zero"
    assert tokenizer.decode(steps[1].observation_ids) == f"\nCode execution result: {error}\n"
    assert (steps[1].done, steps[1].tool_errors) == (False, 1)
    assert (steps[2].done, steps[2].reward, steps[2].tool_calls) == (True, 1.0, 0)
    assert (steps[3].done, steps[3].reward) == (True, 0.0)
    assert (steps[4].done, steps[4].void, steps[4].reward) == (True, True, 0.0)


def test_code_that_prints_the_boxed_answer_ends_the_episode(task, tokenizer):
    (p,) = task.problems("train", 1, seed=1)
    # The mark is built at run time: a turn that holds it literally is an answer turn and runs nothing.
    turn = f"```python\nprint(chr(92) + 'boxed{{' + str({p.answer}) + '}}')\n```"
    (step,) = task.step(tokenizer, [p], [ids(tokenizer, turn)], 0)
    assert (step.done, step.reward, step.tool_calls) == (True, 1.0, 1)


def test_reward_is_exact_on_the_last_boxed_answer(task):
    p = Problem(uid="u", prompt="2 * 3 = ?\n", answer="1000")
    assert task.reward(p, "\\boxed{999} no, \\boxed{1,000}") == 1.0
    assert task.reward(p, "\\boxed{1000.5}") == 0.0
    assert task.reward(p, "1000") == 0.0  # no boxed answer


def test_demonstration_trains_on_model_turns_and_eos_only(task, tokenizer):
    (p,) = task.problems("train", 1, seed=0)
    segments = task.demonstration(p)
    expression = p.metadata["entry"]["metadata"]["expression"]
    assert segments == [(f"```python\nprint({expression})\n```", True),
                        (f"\nCode execution result: {p.answer}\n", False), (f"\\boxed{{{p.answer}}}", True)]
    input_ids, attention, labels = _teacher_forcing_batch(tokenizer, [p], task.demonstration)
    row, lab = input_ids[0].tolist(), labels[0].tolist()
    n_prompt, n_code = len(ids(tokenizer, p.prompt)), len(ids(tokenizer, segments[0][0])) + 1
    n_obs = len(ids(tokenizer, segments[1][0]))
    assert lab[:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert lab[n_prompt : n_prompt + n_code] == row[n_prompt : n_prompt + n_code]
    assert row[n_prompt + n_code - 1] == tokenizer.eos_token_id  # the end of the model's turn
    assert lab[n_prompt + n_code : n_prompt + n_code + n_obs] == [IGNORE_INDEX] * n_obs
    assert lab[-1] == row[-1] == tokenizer.eos_token_id and int(attention.sum()) == len(row)


def test_prompts_keep_the_datasets_split(task):
    train = {p.prompt for p in task.problems("train", 50, seed=0)}
    held_out = {p.prompt for p in task.problems("eval", 50, seed=0)}
    assert not train & held_out and all(p.endswith(" = ?\n") for p in train)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"max_turns": 0}, "task.kwargs.max_turns"),
    ({"tool_timeout_s": -1}, "task.kwargs.tool_timeout_s"),
    ({"answer_match": "fuzzy"}, "task.kwargs.answer_match"),
    ({"mask_void_turns": "yes"}, "task.kwargs.mask_void_turns"),
    ({"no_such_key": 1}, "task.kwargs.no_such_key"),
])
def test_bad_tool_settings_are_one_clear_error(kwargs, named):
    with pytest.raises(TaskError, match=named.replace(".", r"\.")):
        make_task(TaskConfig(name="tools:products", kwargs={**KWARGS, **kwargs}))
