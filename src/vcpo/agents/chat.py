"""Prompts of an agent's calls as token ids, and the model's tool calls in OpenAI's fields.

A call that continues the episode's previous one (its messages are the previous messages, the assistant message the
endpoint answered, then new ones; or its prompt text is the previous prompt plus the completion) is spliced: its ids
are the previous context *as sampled* (prompt ids, then the sampled ids, end-of-turn token included) followed by the
chat template's rendering of what is new. The model's own tokens are never re-tokenized from text, so training sees
exactly what the policy sampled even where a re-rendered transcript would spell it differently.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from vcpo.agents.episodes import Call

SENTINEL = "\x00vcpo-assistant-turn\x00"
"""Stands in for the assistant's turn when the template renders around it (no template writes it itself)."""
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
"""The Hermes / Qwen tool-call format: a JSON object ``{"name": ..., "arguments": {...}}`` between the tags."""


class PromptError(ValueError):
    """A request whose prompt cannot be built (no chat template, a malformed message); answered with HTTP 400."""


@dataclass(frozen=True)
class Prompt:
    """A call's prompt ids, whether they extend the episode's previous context, and what the next call's splice
    compares against (the request's messages and tools, or its prompt text)."""

    ids: list[int]
    spliced: bool
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    text: str | None = None


def message_text(content: Any) -> str:
    """A message's content as text: a string, None, or OpenAI's list of content parts (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise PromptError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it: text content, and tool-call arguments as objects (OpenAI sends strings)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise PromptError("every message needs a string role")
    out = dict(message)
    out["content"] = message_text(message.get("content"))
    calls = []
    for call in message.get("tool_calls") or []:
        function = dict(call.get("function") or {})
        try:
            function["arguments"] = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            pass  # not JSON: the template gets the string as the model wrote it
        calls.append({**call, "function": function})
    if calls:
        out["tool_calls"] = calls
    return out


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool
            ) -> str:
    try:
        return tokenizer.apply_chat_template([_template_message(m) for m in messages], tools=tools or None,
                                             tokenize=False, add_generation_prompt=generation)
    except PromptError:
        raise
    except Exception as e:  # a template that rejects the conversation (jinja's raise_exception, a missing key)
        raise PromptError(f"the chat template rejected the messages: {type(e).__name__}: {e}") from None


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                previous: Call | None) -> Prompt:
    """The prompt ids of a chat call: spliced onto ``previous`` (the episode's last call) when the conversation
    continues it, else the whole conversation rendered (``add_generation_prompt``) and tokenized once."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("this model's tokenizer has no chat template: use /v1/completions")
    if not messages:
        raise PromptError("messages is empty")
    if previous is not None and previous.messages is not None and _continues(messages, tools, previous):
        ids = _spliced_chat(tokenizer, messages, tools, previous)
        if ids is not None:
            return Prompt(ids, True, messages=messages, tools=tools)
    text = _render(tokenizer, messages, tools, generation=True)
    return Prompt(_encode(tokenizer, text), False, messages=messages, tools=tools)


def _continues(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, previous: Call) -> bool:
    """Whether ``messages`` are the previous call's, its answer, then at least one new message."""
    old = previous.messages or []
    if tools != previous.tools or len(messages) < len(old) + 2 or messages[: len(old)] != old:
        return False
    answer = messages[len(old)]
    return (isinstance(answer, dict) and answer.get("role") == "assistant"
            and message_text(answer.get("content")) == previous.reply_text
            and len(answer.get("tool_calls") or []) == previous.reply_tool_calls)


def _spliced_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  previous: Call) -> list[int] | None:
    """Previous context + sampled ids + the template's text after the assistant turn; None when the template does
    not render the conversation as an extension of the previous one (it rewrites earlier turns)."""
    old = previous.messages or []
    stand_in = {"role": "assistant", "content": SENTINEL}
    closed = _render(tokenizer, [*old, stand_in], tools, generation=False)
    opened = _render(tokenizer, [*old, stand_in, *messages[len(old) + 1:]], tools, generation=True)
    at = closed.find(SENTINEL)
    if at < 0 or not opened.startswith(closed):
        return None
    delta = closed[at + len(SENTINEL):] + opened[len(closed):]
    eos_text = getattr(tokenizer, "eos_token", None)
    if previous.finished and eos_text and delta.startswith(eos_text):
        delta = delta[len(eos_text):]  # the sampled turn already ends with it
    return [*previous.context_ids, *_encode(tokenizer, delta)]


def completion_prompt(tokenizer: Any, prompt: str | list[int], previous: Call | None) -> Prompt:
    """The prompt ids of a completions call: token ids as given; text that starts with the previous call's prompt
    and its completion is spliced onto what was sampled; other text is tokenized as is."""
    if isinstance(prompt, list):
        return Prompt(list(prompt), previous is not None and prompt[: len(previous.context_ids)] ==
                      previous.context_ids)
    if previous is not None and previous.prompt_text is not None:
        before = previous.prompt_text + previous.reply_text
        if prompt.startswith(before):
            return Prompt([*previous.context_ids, *_encode(tokenizer, prompt[len(before):])], True, text=prompt)
    return Prompt(_encode(tokenizer, prompt), False, text=prompt)


def parse_tool_calls(text: str, tools_offered: bool) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a model turn: with tools offered, each ``<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`` block that parses becomes an OpenAI tool call (arguments as a JSON string) and leaves the
    content; a block that does not parse stays in the content as written. Without tools the text is the content."""
    if not tools_offered:
        return text, []
    calls, kept, last = [], [], 0
    for match in TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
            name, arguments = body["name"], body.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        if not isinstance(name, str):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        arguments_text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": arguments_text}})
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls
