"""Local dataset files (task.name jsonl / parquet): GSM8K and MATH formats, configurable fields, deterministic splits
and epochs, one error per malformed file naming file and line, and the config checks that run before anything."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vcpo.config import ConfigError, load_config
from vcpo.tasks import DatasetTask, TaskError, make_task
from vcpo.tasks.dataset_task import in_eval_split
from vcpo.tasks.records import DatasetError, read_records, reference_of

GSM8K = [{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
         {"question": "A shop sells 1,000 pens a day for 2 days. How many?", "answer": "2 * 1000 = 2000\n#### 2,000"}]
MATH = [{"problem": "Compute $\\frac{1}{2} + \\frac{1}{4}$.", "solution": "We get $\\boxed{\\frac{3}{4}}$."},
        {"problem": "Solve $x + 1 = 3$.", "solution": "So $x = \\boxed{2}$. Not $\\boxed{3}$? No: $\\boxed{x=2}$"}]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_records_take_the_answer_after_the_hashes(tmp_path):
    records = read_records(write_jsonl(tmp_path / "g.jsonl", GSM8K), "jsonl")
    assert [(r.question, r.answer) for r in records] == [(GSM8K[0]["question"], "7"), (GSM8K[1]["question"], "2000")]
    assert records[1].where == f"{tmp_path / 'g.jsonl'}:2"


def test_math_records_take_the_last_boxed_answer_or_the_answer_field(tmp_path):
    records = read_records(write_jsonl(tmp_path / "m.jsonl", MATH), "jsonl")
    assert [r.answer for r in records] == ["\\frac{3}{4}", "x=2"]
    with_answer = [{"problem": "2+2?", "solution": "long text", "answer": "4"}, {"problem": "x?", "answer": 5}]
    assert [r.answer for r in read_records(write_jsonl(tmp_path / "a.jsonl", with_answer), "jsonl")] == ["4", "5"]


def test_field_names_and_answer_format_are_configurable(tmp_path):
    rows = [{"q": "one plus one", "final": "2"}, {"q": "two plus two", "final": "\\boxed{4}"}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    assert [r.answer for r in read_records(path, "jsonl", prompt_field="q", answer_field="final")] == ["2", "4"]
    rows = [{"question": "q", "answer": "42"}]  # a bare answer under GSM8K's field names
    assert read_records(write_jsonl(tmp_path / "p.jsonl", rows), "jsonl", answer_format="plain")[0].answer == "42"


@pytest.mark.parametrize(("content", "message"), [
    ('{"question": "a", "answer": "#### 1"}\n{"question": "b", "answer": "#### 2"\n', ":2: not valid JSON"),
    ('{"question": "a", "answer": "#### 1"}\n\n{"answer": "#### 2"}\n', ":3: no field 'question'"),
    ('{"question": "a", "answer": "#### 1"}\n{"question": "b", "answer": "it is 2"}\n',
     ":2: field 'answer' has no '####"),
    ('{"problem": "a", "solution": "\\\\boxed{1}"}\n{"problem": "b", "solution": "\\\\boxed{\\\\frac{1}{2}"}\n',
     ":2: field 'solution' has an unbalanced \\boxed{"),
    ('{"problem": "a", "solution": "\\\\boxed{1}"}\n{"problem": "b", "solution": "it is 2"}\n',
     ":2: field 'solution' has no \\boxed{...}"),
    ('["question", "answer"]\n', ":1: a record must be a JSON object"),
    ('{"text": "a"}\n', ":1: none of the fields question, problem, prompt"),
    ('{"question": "a", "answer": {"x": 1}}\n', ":1: field 'answer' must be a string or a number"),
    ("\n\n", ": no records (empty file)"),
])
def test_a_malformed_file_is_one_error_naming_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError) as info:
        read_records(path, "jsonl")
    assert str(info.value).startswith(str(path)) and message in str(info.value)
    assert "\n" not in str(info.value)


def test_parquet_reads_like_jsonl_with_row_numbers(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(GSM8K), tmp_path / "g.parquet")
    records = read_records(tmp_path / "g.parquet", "parquet")
    assert [r.answer for r in records] == ["7", "2000"] and records[1].where == f"{tmp_path / 'g.parquet'} row 2"
    pq.write_table(pa.Table.from_pylist([GSM8K[0], {"question": "b", "answer": "no"}]), tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad\.parquet row 2: field 'answer' has no '####"):
        read_records(tmp_path / "bad.parquet", "parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"junk\.parquet: not a readable Parquet file"):
        read_records(tmp_path / "junk.parquet", "parquet")


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetError, match=r"needs pyarrow, which is not installed: pip install -e '\.\[parquet\]'"):
        read_records(tmp_path / "x.parquet", "parquet")


def sums_file(path: Path, n: int) -> Path:
    return write_jsonl(path, [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(n)])


def test_single_file_split_is_by_question_hash_and_epochs_visit_every_record(tmp_path):
    task = DatasetTask("jsonl", path=str(sums_file(tmp_path / "s.jsonl", 40)), eval_fraction=0.25)
    train, held = task.records["train"], task.records["eval"]
    assert len(train) + len(held) == 40 and held
    assert all(in_eval_split(r.question, 0.25) for r in held)
    assert not any(in_eval_split(r.question, 0.25) for r in train)
    # batches of 4 walk epoch 0's permutation: every train record exactly once in the first len(train) positions
    size = len(train)
    first_epoch = [p.uid for i in range(size) for p in task.stream_batch(i, 1, seed=3)]
    assert sorted(first_epoch) == sorted(f"jsonl/train/{i}" for i in range(size))
    assert [p.uid for p in task.stream_batch(2, 4, 3)] == first_epoch[8:12]  # batch 2 of 4 = positions 8..11
    assert [p.uid for p in task.stream_batch(0, 4, 3)] != [p.uid for p in task.stream_batch(0, 4, 4)]  # by seed
    assert [p.prompt for p in task.problems("eval", 100, seed=1)] == [f"{r.question}\n" for r in held]  # file order


def test_separate_train_and_eval_files(tmp_path):
    task = DatasetTask("jsonl", train_path=str(sums_file(tmp_path / "t.jsonl", 5)),
                       eval_path=str(write_jsonl(tmp_path / "e.jsonl", MATH)))
    assert len(task.records["train"]) == 5
    assert [p.answer for p in task.problems("eval", 9, 0)] == ["\\frac{3}{4}", "x=2"]


def test_config_checks_dataset_settings_before_anything_runs(tmp_path):
    path = sums_file(tmp_path / "s.jsonl", 3)
    assert load_config(None, ["task.name=jsonl", f"task.kwargs.path={path}"]).task.kwargs == {"path": str(path)}
    for overrides, message in [
        ([f"task.kwargs.path={tmp_path / 'missing.jsonl'}"], "task.kwargs.path: '"),
        ([f"task.kwargs.path={path}", "task.kwargs.prompt_feld=q"], "task.kwargs.prompt_feld: not a setting"),
        ([f"task.kwargs.train_path={path}"], "needs task.kwargs.path, or both"),
        ([f"task.kwargs.path={path}", "task.kwargs.answer_format=latex"], "task.kwargs.answer_format: 'latex'"),
        ([f"task.kwargs.path={path}", "task.kwargs.eval_fraction=1.5"], "task.kwargs.eval_fraction: must be"),
        ([f"task.kwargs.path={path}", "task.prompt_format=chat"], "task.prompt_format=chat needs model.path"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(None, ["task.name=jsonl", *overrides])
        assert message in str(info.value) and "\n" not in str(info.value)


def test_an_empty_split_and_a_bad_record_are_task_errors(tmp_path):
    config = load_config(None, ["task.name=jsonl", f"task.kwargs.path={sums_file(tmp_path / 'one.jsonl', 1)}"])
    with pytest.raises(TaskError, match="leave the (train|eval) split empty"):
        make_task(config.task)


@given(st.integers(-10**9, 10**9), st.text(alphabet=st.characters(blacklist_characters="#\r\n"), max_size=30))
def test_a_gsm8k_reference_is_the_number_after_the_hashes_whatever_precedes_it(value, working):
    assert reference_of(f"{working}\n#### {value:,}", "gsm8k", "answer", "f:1") == str(value)


def test_the_hash_split_holds_out_about_the_fraction_asked():
    held = sum(in_eval_split(f"What is {i} + {i % 7}?", 0.2) for i in range(2000))
    assert 340 <= held <= 460  # 2000 x 0.2 = 400 expected; binomial sd 17.9, so this band is beyond 3 sd
