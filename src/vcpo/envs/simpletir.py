"""The SimpleTIR tool protocol (Xue et al. 2025, arXiv 2509.02479): fenced Python blocks run in the sandbox, their
output comes back as ``Code execution result: ...``, the final answer is ``\\boxed{...}``.

Read from SimpleTIR's ``recipe/simpletir/agent_utils.py`` (``execute_predictions``): the first block matching
```` ```(py|python)?\\n...\\n``` ```` is the call; a turn holding ``\\boxed{`` ends the episode; stdout is shown cut
to 512 characters, else the last line of stderr; output that itself holds ``\\boxed{`` ends the episode; a turn with
neither code nor answer is a void turn and ends the episode too.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from vcpo.envs.sandbox import SandboxResult, run_python
from vcpo.rewards.answers import last_boxed

CODE_BLOCK = re.compile(r"```(?:py|python)?\n(.*?)\n```", re.DOTALL)
BOXED_MARK = "\\boxed{"  # SimpleTIR's test for an answer: the mark alone, balanced or not
RESULT_PREFIX = "Code execution result: "
MAX_RESULT_CHARS = 512  # SimpleTIR's cut of the output shown to the model
ERROR_LINES = 1  # SimpleTIR shows the last line of stderr (the exception) on an error


@dataclass(frozen=True)
class ParsedTurn:
    """What a model turn asks for: code to run (the first fenced block) and/or a final answer (``answered``:
    the turn holds ``\\boxed{``, which ends the episode; ``answer``: the last balanced box's content, if any)."""

    code: str | None
    answer: str | None
    answered: bool

    @property
    def void(self) -> bool:
        return self.code is None and not self.answered


def parse_turn(text: str) -> ParsedTurn:
    """The first fenced Python block (stripped) and the final answer of a decoded model turn.

    ``parse_turn("```python\\nprint(2*3)\\n```")`` is ``ParsedTurn(code="print(2*3)", answer=None, answered=False)``;
    ``parse_turn("so \\\\boxed{6}")`` is ``ParsedTurn(code=None, answer="6", answered=True)``; with neither: void.
    An unclosed block is no code (as in SimpleTIR: its regex needs the closing fence).
    """
    match = CODE_BLOCK.search(text)
    return ParsedTurn(code=match.group(1).strip() if match else None, answer=last_boxed(text),
                      answered=BOXED_MARK in text)


def cut_middle(text: str, max_chars: int = MAX_RESULT_CHARS) -> str:
    """``text`` if it fits, else its head and tail around a note of the cut (the middle matters least)."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n...(output cut to {max_chars} characters)...\n{text[-half:]}"


def tool_output(result: SandboxResult) -> tuple[str, bool]:
    """The text the model is shown for a run and whether the run failed.

    Failed (stderr not empty, or killed at its deadline): the last line of stderr, e.g. ``ZeroDivisionError:
    division by zero``. Otherwise stdout without its final newline. Both cut to :data:`MAX_RESULT_CHARS`.
    """
    if result.timed_out:
        return "TimeoutError: the code ran past its wall-clock deadline", True
    if result.stderr.strip():
        last = "\n".join(result.stderr.strip().splitlines()[-ERROR_LINES:])
        return cut_middle(last), True
    return cut_middle(result.stdout.removesuffix("\n")), False


def observation_text(output: str) -> str:
    """What is appended after a tool call: ``"\\nCode execution result: <output>\\n"`` (SimpleTIR's string)."""
    return f"\n{RESULT_PREFIX}{output}\n"


def run_tool_calls(codes: list[str], timeout_s: float, memory_mb: int, workers: int) -> list[SandboxResult]:
    """Run every code string in its own sandbox (``run_python``), ``workers`` at a time, results in order."""
    if not codes:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(codes)))) as pool:
        return list(pool.map(lambda code: run_python(code, timeout_s=timeout_s, memory_mb=memory_mb), codes))
