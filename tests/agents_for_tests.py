"""Agents written with the official ``openai`` client, as a user would write them, for tests/test_agents.py and the
end-to-end runs of tests/test_e2e_agents.py. ``scripted_agent`` behaves as ``problem.metadata["behavior"]`` says."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from openai import APIStatusError, AsyncOpenAI, OpenAI

from vcpo.types import Problem

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def _client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)


def tool_agent(base_url: str, model: str, problem: Problem) -> float:
    """Chat with the ``add`` tool until the model answers (at most 4 calls); 1.0 when the answer holds
    ``problem.answer``."""
    client = _client(base_url)
    messages: list[dict] = [{"role": "user", "content": problem.prompt}]
    for _ in range(4):
        message = client.chat.completions.create(model=model, messages=messages, tools=[ADD_TOOL]).choices[0].message
        if not message.tool_calls:
            return float(problem.answer in (message.content or ""))
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [c.model_dump() for c in message.tool_calls]})
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    return 0.0


async def streaming_agent(base_url: str, model: str, problem: Problem) -> float:
    """The async client, streamed: a completion, then a second one continuing the text with ``" = "``."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    first = await client.completions.create(model=model, prompt=problem.prompt, max_tokens=4)
    text = problem.prompt + first.choices[0].text + " = "
    stream = await client.completions.create(model=model, prompt=text, stream=True)
    second = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    await client.close()
    return float(problem.answer in second)


def sum_agent(base_url: str, model: str, problem: Problem) -> float:
    """Two completion calls (the second continues the first's text): 1.0 when either gives the answer."""
    client = _client(base_url)
    first = client.completions.create(model=model, prompt=problem.prompt).choices[0].text
    second = client.completions.create(model=model, prompt=problem.prompt + first + "\n").choices[0].text
    return float(first.strip() == problem.answer or second.strip() == problem.answer)


def picky_agent(base_url: str, model: str, problem: Problem) -> float:
    """``sum_agent``, except that it raises on problems whose answer is 11."""
    if problem.answer == "11":
        raise ValueError("eleven is not my number")
    return sum_agent(base_url, model, problem)


def broken_agent(base_url: str, model: str, problem: Problem) -> float:
    raise RuntimeError("this agent always fails")


def scripted_agent(base_url: str, model: str, problem: Problem) -> float:
    """``ok``: one call; ``raise``: raises; ``hang``: sleeps past any test's timeout; ``silent``: never calls;
    ``late``: calls, returns, then calls again 0.3 s later from a thread, writing the status it got to
    ``problem.metadata["log"]``; ``late_raise``: the same, but raises instead of returning; ``slow``: sleeps 3 s,
    then calls."""
    behavior = problem.metadata["behavior"]
    client = _client(base_url)
    if behavior == "raise":
        raise ValueError("the agent broke")
    if behavior == "hang":
        time.sleep(600)
    if behavior == "silent":
        return 1.0
    if behavior == "slow":
        time.sleep(3)
    client.completions.create(model=model, prompt=problem.prompt)
    if behavior in ("late", "late_raise"):
        def again() -> None:
            time.sleep(0.3)
            try:
                client.completions.create(model=model, prompt=problem.prompt)
                status = "200"
            except APIStatusError as e:
                status = f"{e.status_code} {e.message}"
            Path(problem.metadata["log"]).write_text(status)

        threading.Thread(target=again).start()
    if behavior == "late_raise":
        raise RuntimeError("gave up")
    return 1.0
