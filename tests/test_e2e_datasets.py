"""End to end through the real command line: training steps on a GSM8K-format JSONL file with a chat-template
tokenizer and math-verify rewards, `vcpo eval` per dataset, one-line errors, and the example configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vcpo.config import load_config
from vcpo.models.default import build_default_model
from vcpo.models.loading import load_policy
from vcpo.tasks import DatasetTask, PromptFormat
from vcpo.train.sft import train_sft

from conftest import CHAT_TEMPLATE, ROOT, metrics, vcpo


def sums(path: Path, n: int, offset: int = 0) -> Path:
    """GSM8K-format sums of two numbers below 5: a few SFT steps teach the tiny model some of them."""
    rows = [{"question": f"What is {i % 5} + {(i // 5 + offset) % 5}?",
             "answer": f"{i % 5} + {(i // 5 + offset) % 5}\n#### {i % 5 + (i // 5 + offset) % 5}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A tiny model whose tokenizer has a chat template, fine-tuned for 30 steps on chat prompts of the train file
    (so math-verify finds right answers in training: about 1 sample in 7 here), train/eval files, a malformed file."""
    root = tmp_path_factory.mktemp("e2e")
    train, test = sums(root / "train.jsonl", 25), sums(root / "test.jsonl", 6, offset=2)
    task = DatasetTask("jsonl", PromptFormat("chat", instruction=""), train_path=str(train), eval_path=str(test))
    model_dir = build_default_model(task, 0, root / "model")
    model, tokenizer = load_policy(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    train_sft(model, tokenizer, task.problems("train", 30 * 16, seed=0), 30, 16, 3e-3, say=lambda *_: None)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    bad = root / "bad.jsonl"
    bad.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n{"question": "2 + 2?", "answer": "four"}\n')
    return {"root": root, "train": train, "test": test, "model": model_dir, "bad": bad}


def common(files: dict[str, Path]) -> list[str]:
    return [f"model.path={files['model']}", "task.name=jsonl", f"task.kwargs.train_path={files['train']}",
            f"task.kwargs.eval_path={files['test']}", "task.prompt_format=chat", "task.instruction=",
            "rollout.max_new_tokens=8", "runtime.torch_threads=1"]


def test_training_steps_on_a_jsonl_file_with_chat_prompts_and_math_rewards(files, tmp_path):
    run = tmp_path / "run"
    vcpo("train", *common(files), f"run_dir={run}", "async.mode=async", "async.max_staleness=1", "trainer.max_steps=3",
         "rollout.prompts_per_step=4", "rollout.group_size=8", "trainer.eval_every=0", "trainer.eval_samples=2",
         "logging.progress=false")
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert sum(m["reward/mean"] for m in lines) > 0  # math-verify found a right final answer somewhere
    assert all(m["reward/errors"] == 0 and m["reward/timeouts"] == 0 for m in lines)
    assert {"eval/accuracy", "eval/mean@2", "eval/pass@2"} <= lines[-1].keys()
    assert lines[-1]["eval/mean@2"] <= lines[-1]["eval/pass@2"]
    assert load_config(run / "config.yaml").task.prompt_format == "chat"


def test_vcpo_eval_reports_every_dataset_as_json_and_a_table(files, tmp_path):
    out = tmp_path / "eval.json"
    proc = vcpo("eval", str(files["model"]), *common(files), "--samples", "3", "--temperature", "1.0",
                "--dataset", str(files["test"]), "--dataset", str(files["train"]), "--out", str(out))
    report = json.loads(out.read_text())
    assert (report["samples"], report["temperature"], report["top_p"]) == (3, 1.0, 0.7)
    assert list(report["datasets"]) == ["test", "train"]
    assert report["datasets"]["test"]["problems"] == 6 and report["datasets"]["train"]["problems"] == 25
    for row in report["datasets"].values():
        assert {"accuracy", "mean@3", "pass@3"} <= row.keys() and 0 <= row["mean@3"] <= row["pass@3"] <= 1
    assert "mean@3" in proc.stdout and "pass@3" in proc.stdout and "greedy accuracy" in proc.stdout


def test_user_errors_are_one_line_and_write_nothing(files, tmp_path):
    run = tmp_path / "bad-run"
    proc = vcpo("train", *common(files)[:3], f"task.kwargs.eval_path={files['bad']}", f"run_dir={run}", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert f"{files['bad']}:2: field 'answer' has no '####" in proc.stderr and not run.exists()
    plain = files["root"] / "plain-model"
    if not plain.exists():
        build_default_model(DatasetTask("jsonl", train_path=str(files["train"]), eval_path=str(files["test"])), 0,
                            plain)
    proc = vcpo("train", *common(files), f"model.path={plain}", f"run_dir={run}", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: task.prompt_format=chat but the tokenizer of")
    assert proc.stderr.strip().count("\n") == 0 and not run.exists()


@pytest.mark.parametrize("name", ["gsm8k", "math"])
def test_the_example_configs_load_with_their_paths_pointed_at_test_files(files, name):
    config = load_config(ROOT / "configs" / f"{name}.yaml", [f"model.path={files['model']}",
                                                            f"task.kwargs.train_path={files['train']}",
                                                            f"task.kwargs.eval_path={files['test']}"])
    assert config.task.prompt_format == "chat" and config.task.name in ("jsonl", "parquet")
    assert config.model.dtype == "bfloat16" and config.async_.mode == "async"
