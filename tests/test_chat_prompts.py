"""Chat-format prompts: the tokenizer's chat template with a system prompt and the instruction, tokenized once; the
trajectories carry exactly those ids; a tokenizer without a template is one clear error; raw prompts are unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vcpo.models.default import BASE_CHARACTERS, build_char_tokenizer, build_default_model
from vcpo.models.files import declares_chat_template
from vcpo.models.loading import load_policy
from vcpo.rollout.collect import collect_groups
from vcpo.rollout.engine import HFRolloutEngine
from vcpo.tasks import DatasetTask, PromptFormat, ReasoningGymTask, encode_prompts
from vcpo.tasks.prompts import BOXED_INSTRUCTION, PromptFormatError, check_prompt_format
from vcpo.types import SamplingParams

from conftest import CHAT_TEMPLATE


def template_tokenizer():
    tokenizer = build_char_tokenizer(BASE_CHARACTERS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def sums(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i} + 1 = ?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(30)))
    return path


def test_chat_prompt_ids_are_the_rendered_template_character_by_character(sums):
    tokenizer = template_tokenizer()
    task = DatasetTask("jsonl", PromptFormat("chat", system_prompt="Be brief."), train_path=str(sums),
                       eval_path=str(sums))
    problem = task.problems("eval", 1, 0)[0]
    assert problem.messages == ({"role": "system", "content": "Be brief."},
                                {"role": "user", "content": f"0 + 1 = ?\n{BOXED_INSTRUCTION}"})
    expected = f"<|system|>Be brief.\n<|user|>0 + 1 = ?\n{BOXED_INSTRUCTION}\n<|assistant|>"
    ids = encode_prompts(tokenizer, [problem])[0]
    # one token per character, no special token added: the ids spell the rendered template exactly
    assert ids == [tokenizer.convert_tokens_to_ids(ch) for ch in expected]
    assert tokenizer.decode(ids) == expected


def test_raw_prompts_and_the_instruction_setting(sums):
    tokenizer = template_tokenizer()
    raw = DatasetTask("jsonl", train_path=str(sums), eval_path=str(sums)).problems("eval", 1, 0)[0]
    assert raw.messages is None and raw.prompt == "0 + 1 = ?\n"
    assert encode_prompts(tokenizer, [raw])[0] == tokenizer("0 + 1 = ?\n", add_special_tokens=False)["input_ids"]
    told = DatasetTask("jsonl", PromptFormat("raw", instruction="Think."), train_path=str(sums), eval_path=str(sums))
    assert told.problems("eval", 1, 0)[0].prompt == "0 + 1 = ?\nThink.\n"
    bare = DatasetTask("jsonl", PromptFormat("chat", instruction=""), train_path=str(sums), eval_path=str(sums))
    assert bare.problems("eval", 1, 0)[0].messages == ({"role": "user", "content": "0 + 1 = ?"},)


def test_reasoning_gym_raw_prompts_are_unchanged_and_chat_uses_the_question():
    kwargs = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    raw = ReasoningGymTask("chain_sum", **kwargs).problems("eval", 3, seed=0)
    assert all(p.prompt.endswith(" = ") and p.messages is None for p in raw)
    chat = ReasoningGymTask("chain_sum", prompt_format=PromptFormat("chat"), **kwargs).problems("eval", 3, seed=0)
    assert all(p.messages[-1]["content"] == f"{p.metadata['entry']['question'].strip()}\n{BOXED_INSTRUCTION}"
               for p in chat)


def test_a_tokenizer_without_a_chat_template_is_one_clear_error(sums):
    task = DatasetTask("jsonl", PromptFormat("chat"), train_path=str(sums), eval_path=str(sums))
    plain = build_char_tokenizer(BASE_CHARACTERS)
    with pytest.raises(PromptFormatError, match=r"^task\.prompt_format=chat but the tokenizer of /m has no chat "):
        check_prompt_format(plain, task.problems("eval", 2, 0), "/m")
    with pytest.raises(PromptFormatError):
        encode_prompts(plain, task.problems("eval", 1, 0))


def test_trajectories_carry_the_exact_ids_the_engine_sampled_from(sums, tmp_path):
    task = DatasetTask("jsonl", PromptFormat("chat"), train_path=str(sums), eval_path=str(sums))
    build_default_model(task, seed=0, out_dir=tmp_path / "m")
    model, tokenizer = load_policy(tmp_path / "m")
    tokenizer.chat_template = CHAT_TEMPLATE
    problems = task.problems("train", 2, seed=0)
    seen: list[list[int]] = []
    engine = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    generate = engine.generate

    def spy(prompt_ids, *args, **kwargs):
        seen.extend(prompt_ids)
        return generate(prompt_ids, *args, **kwargs)

    engine.generate = spy
    groups = collect_groups(engine, tokenizer, task, problems, [0, 1], 2, SamplingParams(max_new_tokens=3),
                            torch.Generator().manual_seed(0))
    expected = [tokenizer.apply_chat_template([dict(m) for m in p.messages], add_generation_prompt=True,
                                              tokenize=False) for p in problems]
    assert [tokenizer.decode(t.prompt_ids) for g in groups for t in g] == [e for e in expected for _ in range(2)]
    assert [t.prompt_ids for g in groups for t in g] == seen


def test_a_model_directory_says_whether_its_tokenizer_has_a_chat_template(tmp_path):
    tokenizer = build_char_tokenizer(BASE_CHARACTERS)
    tokenizer.save_pretrained(tmp_path / "plain")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "chat")
    assert declares_chat_template(tmp_path / "chat") is True
    assert declares_chat_template(tmp_path / "plain") is False
    assert declares_chat_template(tmp_path / "missing") is None  # unknown: loading the model decides
