"""A user's own reward on a JSONL dataset: partial credit for reversing a word, where math-verify would give 0 or 1.

Named in the config by its import path (config.yaml here), beside the dataset file words.jsonl:

    task:
      name: jsonl
      kwargs: {path: words.jsonl}
      reward: reverse_reward:char_match

vcpo calls ``char_match(completion, answer)`` with the text the model generated and the record's ``answer``
field, in its sandboxed scoring pool like its own rewards: a reward that raises scores 0 (counted in
``reward/errors``), one that hangs is killed at ``task.reward_timeout_s`` and scores 0.
"""

from __future__ import annotations


def char_match(completion: str, answer: str) -> float:
    """The share of positions where the completion's first line and the answer agree, over the longer of the
    two: ``"cba"`` for ``"cba"`` scores 1, ``"cbx"`` 2/3, ``"cbaa"`` 3/4, nothing 0."""
    lines = completion.strip().splitlines()
    guess = lines[0].strip() if lines else ""
    hits = sum(g == a for g, a in zip(guess, answer, strict=False))
    return hits / max(len(guess), len(answer), 1)
