"""math_reward (API.md §6): answer extraction by hand-picked cases, equivalence through math-verify in the pool,
and a pathological input cut at the deadline from a non-main thread while the machine is busy."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vcpo.rewards import math_reward, math_rewards, shared_pool
from vcpo.rewards.answers import after_hashes, extract_answer, last_boxed, last_number, reference_answer


@pytest.mark.parametrize(("text", "expected"), [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # the last one, nested braces kept whole
    (r"\boxed{a} and an unclosed \boxed{b", "a"),  # an unbalanced last box falls back to the complete one
    (r"\boxed {x^{2}}", "x^{2}"),
    (r"\fbox{7}", "7"),
    ("no box", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("she has 3 apples\n#### 42", "42"),
    ("#### 1 \n#### 1,000.\nmore", "1,000"),  # the last marker; its line; trailing period dropped
    ("####", None),
    ("none", None),
])
def test_after_hashes(text, expected):
    assert after_hashes(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("it costs 12 dollars, then -7", "-7"),
    ("a total of 1,000 apples", "1,000"),
    ("1, 2, 3", "3"),  # a list, not a thousands number
    ("pi is 3.14", "3.14"),
    ("three quarters is 3/4.", "3/4"),
    ("x = .5", ".5"),
    ("no digits", None),
])
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_extraction_order_and_normalization():
    assert extract_answer(r"#### 5 but \boxed{6}") == "6"  # a box beats ####
    assert extract_answer("7 then\n#### 8\nand 9 after") == "8"  # #### (its line) beats the last number
    assert extract_answer("about 1,234,567 people") == "1234567"  # thousands separators dropped
    assert extract_answer("nothing") is None
    assert reference_answer("Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18") == "18"  # a GSM8K answer field
    assert reference_answer(r"so $x = \boxed{\frac{2}{3}}$") == r"\frac{2}{3}"  # a MATH solution
    assert reference_answer("x^2 + 1") == "x^2 + 1"  # a bare reference is never cut to its last number


@given(st.text(max_size=300))
@settings(max_examples=200, deadline=None)
def test_extraction_never_raises(text):
    answer = extract_answer(text)
    assert answer is None or (isinstance(answer, str) and answer)


@pytest.mark.parametrize(("completion", "answer", "expected"), [
    (r"the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{x = 3}", "3", 1.0),
    (r"\boxed{3}", "x=3", 1.0),
    (r"\boxed{\{3, 1, 2\}}", r"\{1,2,3\}", 1.0),  # sets in any order
    (r"\boxed{(0, 1]}", "(0,1]", 1.0),
    (r"\boxed{[0, 1]}", "(0,1]", 0.0),  # a closed interval is not a half-open one
    (r"so it is \boxed{5 \text{ cm}}", "5", 1.0),  # units and text around the answer
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
    ("#### 42", "#### 42", 1.0),  # a GSM8K answer field as the reference
    ("In total 1,000 apples", "1000", 1.0),  # the last number, thousands separators
    ("she owes -15 dollars", "-15", 1.0),
    ("she owes 15 dollars", "-15", 0.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"\boxed{2}", "3", 0.0),
    ("no answer here", "3", 0.0),
])
def test_equivalent_and_different_pairs(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_batch_api_and_its_errors():
    outcomes = math_rewards([r"\boxed{2}", r"\boxed{3}"], ["2", "2"])
    assert [(o.reward, o.status) for o in outcomes] == [(1.0, "ok"), (0.0, "ok")]
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        math_rewards(["1", "2"], ["1"])


def test_input_length_is_capped_to_the_tail():
    assert math_reward("blah " * 40_000 + r"so \boxed{7}", "7") == 1.0  # 200 kB: scored on its last 16,384 chars
    assert math_reward(r"\boxed{7}" + " and so on" * 2_000, "7") == 0.0  # the answer fell outside the cap


def test_code_in_an_answer_does_not_run_here(tmp_path):
    marker = tmp_path / "ran"
    completion = rf"\boxed{{__import__('os').system('touch {marker}')}}"
    assert math_reward(completion, "0") == 0.0
    assert not marker.exists()


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_pathological_input_is_cut_at_the_deadline_off_the_main_thread_under_load():
    """A power tower that sympy would evaluate for ages: cut at timeout_s, from a worker thread, while two
    CPU-burning processes and other scoring threads compete for the 2 cores."""
    shared_pool().score([], 1.0)
    math_reward(r"\boxed{1}", "1")  # warm workers: the clock below measures the deadline, not start-up
    burners = [multiprocessing.get_context("spawn").Process(target=_burn, args=(8.0,)) for _ in range(2)]
    for b in burners:
        b.start()
    result: dict[str, float] = {}

    def pathological() -> None:
        start = time.perf_counter()
        result["reward"] = math_reward(r"\boxed{9^{9^{9^{9^{9}}}}}", "3", timeout_s=2.0)
        result["elapsed"] = time.perf_counter() - start

    def ordinary() -> None:
        result["ordinary"] = math_reward(r"\boxed{\frac{6}{4}}", "1.5", timeout_s=30.0)

    before = shared_pool().counts()["timeout"]
    try:
        threads = [threading.Thread(target=pathological), threading.Thread(target=ordinary)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        for b in burners:
            b.terminate()
            b.join()
    assert result["reward"] == 0.0
    assert 2.0 <= result["elapsed"] < 3.5  # the deadline plus the kill, not the power tower's hours
    assert result["ordinary"] == 1.0
    assert shared_pool().counts()["timeout"] == before + 1
