"""Tasks, the embedded default model, policy loading and the cached supervised warm start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from vcpo.config import (
    ArchitectureConfig,
    Config,
    ConfigError,
    LoggingConfig,
    ModelConfig,
    SFTConfig,
    TaskConfig,
    load_config,
)
from vcpo.models import ModelLoadError, build_char_tokenizer, build_default_model, load_policy
from vcpo.tasks import ReasoningGymTask, Task, TaskError, make_task
from vcpo.tasks.reasoning_gym_task import generator_seed
from vcpo.train import evaluate, sft
from vcpo.types import Problem

SMALL_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


@pytest.fixture(scope="module")
def task() -> ReasoningGymTask:
    return ReasoningGymTask("chain_sum", **SMALL_SUMS)


@pytest.fixture(scope="module")
def model_dir(task, tmp_path_factory) -> Path:
    return build_default_model(task, seed=0, out_dir=tmp_path_factory.mktemp("default_model"))


# ---- tasks ----------------------------------------------------------------------------------


def test_problems_are_deterministic_per_seed(task):
    assert isinstance(task, Task)
    first = task.problems("train", 20, seed=3)
    assert first == task.problems("train", 20, seed=3)
    assert [p.prompt for p in first] != [p.prompt for p in task.problems("train", 20, seed=4)]
    # the prompt keeps only the expression, e.g. "3 + 4 = ", and the answer is its value
    a, op, b = first[0].prompt.removesuffix(" = ").split(" ")
    assert int(first[0].answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_decimal_sums_keep_only_the_expression():
    # issue 46's held-out setting: decimal_chain_sum reads like chain_sum ("7.8 + 6.1 = "), its answer the value
    task = ReasoningGymTask("decimal_chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1,
                            min_decimal_places=1, max_decimal_places=1)
    for problem in task.problems("eval", 20, seed=0):
        a, op, b = problem.prompt.removesuffix(" = ").split(" ")
        assert float(problem.answer) == pytest.approx(float(a) + float(b) if op == "+" else float(a) - float(b))
        assert task.reward(problem, problem.answer) == 1.0


def test_train_and_eval_never_share_seeds_or_prompts(task):
    assert generator_seed("chain_sum", "train", 0) != generator_seed("chain_sum", "eval", 0)
    train = {p.prompt for p in task.problems("train", 300, seed=0)}
    held_out = {p.prompt for p in task.problems("eval", 100, seed=0)}
    # one-digit sums have only 200 distinct prompts: without the split by prompt they would overlap
    assert train and held_out and not train & held_out
    with pytest.raises(TaskError, match="'test'"):
        task.problems("test", 1, seed=0)


def test_reward_of_right_and_wrong_answers(task):
    problem = task.problems("eval", 1, seed=0)[0]
    wrong = str(int(problem.answer) + 1)
    assert task.reward(problem, problem.answer) == 1.0
    assert task.reward(problem, f"  {problem.answer}\n") == 1.0
    assert task.reward(problem, wrong) == 0.0
    assert task.reward(problem, "") == 0.0
    assert task.reward(problem, "<<garbage>>") == 0.0


def test_make_task_errors_name_the_culprit():
    with pytest.raises(TaskError, match="'chainsum'.*chain_sum"):
        make_task(TaskConfig(name="chainsum"))
    with pytest.raises(TaskError, match=r"task\.kwargs\.digits.*min_digits"):
        make_task(TaskConfig(name="chain_sum", kwargs={"digits": 2}))
    with pytest.raises(TaskError, match="max_terms"):
        make_task(TaskConfig(name="chain_sum", kwargs={"min_terms": 5, "max_terms": 2}))


# ---- default model and loading ----------------------------------------------------------------


def test_char_tokenizer_round_trip():
    tok = build_char_tokenizer("0123456789+-= ")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    ids = tok("12 + 3 = 15", add_special_tokens=False)["input_ids"]
    assert len(ids) == 11  # one token per character, spaces included
    assert tok.decode(ids) == "12 + 3 = 15"
    assert tok.decode([*ids, tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == "12 + 3 = 15"
    assert tok("x", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_default_model_loads_offline_with_auto_classes(model_dir, task):
    assert (model_dir / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert model.config.vocab_size == len(tok)
    for problem in task.problems("eval", 20, seed=1):
        ids = tok(problem.prompt + problem.answer, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == problem.prompt + problem.answer


def test_load_policy_errors_are_one_line_and_name_the_path(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    alien = tmp_path / "alien"
    alien.mkdir()
    (alien / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    cases = {tmp_path / "missing": "does not exist", empty: "no config.json", broken: "config.json", alien: ""}
    for path, what in cases.items():
        with pytest.raises(ModelLoadError) as info:
            load_policy(path)
        message = str(info.value)
        assert str(path) in message and what in message and "\n" not in message


def test_load_policy_falls_back_to_eos_for_padding(model_dir, tmp_path):
    copy = Path(shutil.copytree(model_dir, tmp_path / "no_pad"))
    tok = AutoTokenizer.from_pretrained(copy, local_files_only=True)
    PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<eos>").save_pretrained(copy)
    model, tokenizer = load_policy(copy)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 1
    assert not model.training


# ---- supervised warm start ----------------------------------------------------------------------


def _tiny_config(cache_dir: Path) -> Config:
    return Config(
        task=TaskConfig(name="chain_sum", kwargs=SMALL_SUMS, eval_size=8),
        sft=SFTConfig(steps=3, batch_size=8, cache_dir=str(cache_dir)),
        logging=LoggingConfig(progress=False),
    )


def test_warm_start_caches_and_reuses(tmp_path, monkeypatch):
    config = _tiny_config(tmp_path / "cache")
    path = sft.warm_start(config)
    assert path.parent == tmp_path / "cache" and path.name.endswith(sft.cache_key(config))
    summary = json.loads((path / sft.SUMMARY_FILE).read_text())
    assert summary["steps"] == 3 and 0.0 <= summary["eval_accuracy"] <= 1.0
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # no temporary directory left
    weights_mtime = (path / "model.safetensors").stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("the cached model was retrained")

    monkeypatch.setattr(sft, "train_sft", no_training)
    assert sft.warm_start(config) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == weights_mtime
    # a different setting is a different cache entry
    assert sft.cache_key(config.model_copy(update={"seed": 1})) != sft.cache_key(config)


def test_sft_architecture_shapes_the_default_model_and_its_cache_key(tmp_path):
    """sft.architecture builds another shape (what the larger-model study warm-starts); the default key is unchanged."""
    config = _tiny_config(tmp_path / "cache")
    assert config.sft.architecture == ArchitectureConfig(hidden_size=128, num_layers=2, num_heads=4,
                                                         intermediate_size=384)
    wide = config.model_copy(update={"sft": config.sft.model_copy(update={"architecture": ArchitectureConfig(
        hidden_size=96, num_layers=3, num_heads=6, intermediate_size=160)})})
    assert sft.cache_key(wide) != sft.cache_key(config)
    path = sft.warm_start(wide)
    shape = json.loads((path / "config.json").read_text())
    assert [shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                               "intermediate_size")] == [96, 3, 6, 6, 160]
    assert json.loads((path / sft.SUMMARY_FILE).read_text())["architecture"] == {
        "hidden_size": 96, "num_layers": 3, "num_heads": 6, "intermediate_size": 160}
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["sft.architecture.hidden_size=96", "sft.architecture.num_heads=5"])
    assert str(bad.value) == "sft.architecture.num_heads (5) must divide sft.architecture.hidden_size (96)"


def test_warm_start_returns_a_given_model_path_unchanged(tmp_path):
    config = _tiny_config(tmp_path / "cache").model_copy(update={"model": ModelConfig(path="/some/model")})
    assert sft.warm_start(config) == Path("/some/model")
    assert not (tmp_path / "cache").exists()


def test_evaluate_accuracy_counts_exact_greedy_matches(model_dir, task):
    model, tok = load_policy(model_dir)
    problems = task.problems("eval", 4, seed=2)
    greedy = evaluate.greedy_completions(model, tok, problems, max_new_tokens=3)

    class ExactMatch:
        name = "exact"

        def reward(self, problem: Problem, completion: str) -> float:
            return float(completion == problem.answer)

    # make the first three answers what the model says greedily; the last one can never match (>3 tokens)
    rigged = [Problem(p.uid, p.prompt, g) for p, g in zip(problems[:3], greedy[:3], strict=True)]
    rigged.append(Problem("never", problems[3].prompt, "never"))
    assert evaluate.evaluate_accuracy(model, tok, ExactMatch(), rigged, max_new_tokens=3, batch_size=2) == 0.75
