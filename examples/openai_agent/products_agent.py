"""The tool task's products (configs/tools.yaml) written as an agent for the OpenAI API: the model writes a fenced
Python block, the agent runs it in vcpo's sandbox and sends the output back, until a final ``\\boxed{}`` answer.

Trained by vcpo as ``task.name: agent:products_agent:solve`` (config.yaml beside this file). Nothing here knows
about training: point ``base_url`` at any OpenAI-compatible server and it runs the same.
"""

from __future__ import annotations

from openai import OpenAI

from vcpo.envs.simpletir import BOXED_MARK, observation_text, parse_turn, run_tool_calls, tool_output
from vcpo.rewards.answers import last_boxed, normalize_number
from vcpo.types import Problem

MAX_TURNS = 3
TOOL_TIMEOUT_S = 5.0
TOOL_MEMORY_MB = 512


def _reward(text: str, answer: str) -> float:
    boxed = last_boxed(text)
    return float(boxed is not None and normalize_number(boxed) == normalize_number(answer))


def solve(base_url: str, model: str, problem: Problem) -> float:
    """One SimpleTIR episode over the completions API; the reward is 1.0 for the right boxed answer.

    Each call sends the whole transcript so far (the prompt, the model's turns, the tool outputs); vcpo's endpoint
    recognises it as the previous call continued, so the model's turns are trained on as sampled (end-of-turn
    token included) and the tool output is masked."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    transcript = problem.prompt
    for _ in range(MAX_TURNS):
        turn = client.completions.create(model=model, prompt=transcript).choices[0].text
        parsed = parse_turn(turn)
        if parsed.answered:
            return _reward(turn, problem.answer)
        if parsed.code is None:  # neither code nor an answer: the episode ends unsolved
            return 0.0
        (result,) = run_tool_calls([parsed.code], TOOL_TIMEOUT_S, TOOL_MEMORY_MB, workers=1)  # in the sandbox
        output, _ = tool_output(result)
        if BOXED_MARK in output:
            return _reward(output, problem.answer)
        transcript += turn + observation_text(output)
    return 0.0
