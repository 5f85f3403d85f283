"""How a problem is shown to the model: raw text, or chat messages through the tokenizer's chat template, and the
one place where prompts become token ids (the ids the engine samples from are the ids the learner trains on)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vcpo.models.files import no_chat_template
from vcpo.tasks.base import TaskError
from vcpo.types import Problem

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class PromptFormatError(TaskError):
    """``task.prompt_format: chat`` with a tokenizer that has no chat template; one line naming the fix."""


@dataclass(frozen=True)
class PromptFormat:
    """``task.prompt_format``, ``task.system_prompt`` and ``task.instruction`` of a config.

    ``instruction=None`` means the format's default: :data:`BOXED_INSTRUCTION` in chat format, none in raw format
    (raw prompts stay exactly what the task has always produced); ``""`` means no instruction.
    """

    kind: str = "raw"
    system_prompt: str | None = None
    instruction: str | None = None

    @property
    def effective_instruction(self) -> str:
        if self.instruction is not None:
            return self.instruction
        return BOXED_INSTRUCTION if self.kind == "chat" else ""

    def problem(self, uid: str, question: str, raw_prompt: str, answer: str, metadata: dict[str, Any]) -> Problem:
        """The problem for ``question``: in raw format its prompt is ``raw_prompt`` (the task's own text, which
        places :attr:`effective_instruction` itself); in chat format its ``messages`` are an optional system
        message and one user message, ``question`` then the instruction on a new line."""
        if self.kind == "raw":
            return Problem(uid=uid, prompt=raw_prompt, answer=answer, metadata=metadata)
        instruction = self.effective_instruction
        user = f"{question}\n{instruction}" if instruction else question
        messages = ({"role": "system", "content": self.system_prompt},) if self.system_prompt else ()
        messages += ({"role": "user", "content": user},)
        return Problem(uid=uid, prompt=user, answer=answer, metadata=metadata, messages=messages)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def missing_chat_template(where: str) -> PromptFormatError:
    """The error for chat prompts and the tokenizer of ``where`` (a model directory), which has no chat template."""
    return PromptFormatError(no_chat_template(where))


def check_prompt_format(tokenizer: Any, problems: list[Problem], where: str) -> None:
    """Raise :func:`missing_chat_template` when a chat-format problem meets a tokenizer without a chat template."""
    if any(p.messages is not None for p in problems) and not has_chat_template(tokenizer):
        raise missing_chat_template(where)


def encode_prompt(tokenizer: Any, problem: Problem) -> list[int]:
    """The token ids of ``problem``'s prompt, computed once and carried in the trajectory from then on.

    Raw format: the prompt text, no special tokens added. Chat format: the chat template rendered with
    ``add_generation_prompt=True`` (so the model answers as the assistant), then tokenized without adding special
    tokens: the template writes its own (a BOS, role markers), and adding them again would double a BOS.
    """
    if problem.messages is None:
        return list(tokenizer(problem.prompt, add_special_tokens=False)["input_ids"])
    check_prompt_format(tokenizer, [problem], "this model")
    text = tokenizer.apply_chat_template([dict(m) for m in problem.messages], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompts(tokenizer: Any, problems: list[Problem]) -> list[list[int]]:
    """:func:`encode_prompt` of each problem."""
    return [encode_prompt(tokenizer, p) for p in problems]
