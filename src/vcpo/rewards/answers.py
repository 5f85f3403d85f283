"""Final-answer extraction from model text (pure string functions, no sympy): the last ``\\boxed{...}``, else
``#### x``, else the last number. Used inside the reward workers before math-verify compares."""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces balance, else None.

    ``"so \\boxed{\\frac{1}{2}}."`` -> ``"\\frac{1}{2}"``; an unclosed ``\\boxed{`` is skipped in favour of
    an earlier complete one.
    """
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def after_hashes(text: str) -> str | None:
    """GSM8K's final answer: the rest of the line after the last ``####`` (trailing period dropped)."""
    index = text.rfind("####")
    if index < 0:
        return None
    answer = text[index + 4 :].split("\n", 1)[0].strip().rstrip(".").strip()
    return answer or None


def last_number(text: str) -> str | None:
    """The last number in ``text``: integers, decimals, ``1,000``-style thousands and ``a/b`` fractions."""
    found = _NUMBER.findall(text)
    return found[-1].replace(" ", "") if found else None


def normalize_number(answer: str) -> str:
    """``"1,000"`` -> ``"1000"`` (thousands separators would otherwise read as a tuple); others unchanged."""
    stripped = answer.strip()
    return stripped.replace(",", "") if _THOUSANDS.match(stripped) else stripped


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion: last ``\\boxed{}``, else ``#### x``, else the last number; None if none."""
    for extract in (last_boxed, after_hashes, last_number):
        answer = extract(completion)
        if answer:
            return normalize_number(answer)
    return None


def reference_answer(answer: str) -> str:
    """The gold answer to compare with: its own ``\\boxed{}`` or ``#### x`` when it has one (a MATH solution or
    a GSM8K answer field), else the text itself (never its last number: ``x^2 + 1`` stays whole)."""
    marked = last_boxed(answer) or after_hashes(answer)
    return normalize_number(marked if marked else answer)
