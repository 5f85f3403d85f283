"""Local dataset files (``task.name: jsonl`` or ``parquet``) as a :class:`~vcpo.tasks.base.Task`: GSM8K- and
MATH-format records, deterministic splits and epochs, scored by math-verify in the sandboxed pool."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

from vcpo.plugins import is_import_path
from vcpo.rewards.pool import RewardOutcome, ScoreRequest, shared_pool
from vcpo.tasks.base import SPLITS, TaskError
from vcpo.tasks.prompts import PromptFormat
from vcpo.tasks.records import DatasetError, Record, check_dataset_kwargs, read_records
from vcpo.types import Problem


def in_eval_split(question: str, eval_fraction: float) -> bool:
    """Whether a question of a single-file dataset is held out: the first 8 bytes of its SHA-256, read as a
    fraction of 2**64, fall below ``eval_fraction``. Independent of the file's order and of the seed; a question
    that appears twice lands on one side only."""
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") < eval_fraction * 2**64


class DatasetTask:
    """Problems from a local JSONL or Parquet file, each scored 1.0 when the completion's final answer is equivalent
    to the record's under math-verify (:func:`vcpo.rewards.math_reward`, in the sandboxed scoring pool), or by a
    user's ``reward`` function (an import path ``module:fn``, ``fn(completion, answer)``, in the same pool).

    ``path`` alone: records are held out by :func:`in_eval_split` (``eval_fraction``, default 0.1);
    ``train_path`` and ``eval_path``: one file per split. Training batches walk the train records in epochs, each
    epoch a fresh permutation by the seed (:meth:`stream_batch`); the eval split is the first ``n`` held-out records
    in file order, the same for every seed. Field names and the answer format: :func:`records.read_records`.
    """

    def __init__(self, name: str, prompt_format: PromptFormat | None = None, reward_timeout_s: float = 5.0,
                 reward_workers: int = 1, reward: str = "math", **kwargs: Any) -> None:
        try:
            check_dataset_kwargs(name, kwargs)
            read = {k: kwargs[k] for k in ("prompt_field", "answer_field", "answer_format") if k in kwargs}
            if "path" in kwargs:
                records = read_records(Path(kwargs["path"]), name, **read)
                fraction = float(kwargs.get("eval_fraction", 0.1))
                split = {s: [r for r in records if in_eval_split(r.question, fraction) == (s == "eval")]
                         for s in SPLITS}
                for s, chosen in split.items():
                    if not chosen:
                        raise DatasetError(f"{kwargs['path']}: {len(records)} records leave the {s} split empty at "
                                           f"eval_fraction={fraction} (set task.kwargs.eval_fraction, or give "
                                           "train_path and eval_path)")
            else:
                split = {s: read_records(Path(kwargs[f"{s}_path"]), name, **read) for s in SPLITS}
        except DatasetError as exc:
            raise TaskError(str(exc)) from None
        self.name = name
        self.records: dict[str, list[Record]] = split
        self.format = prompt_format or PromptFormat()
        self.reward_timeout_s = reward_timeout_s
        self.reward_workers = reward_workers
        if reward not in ("native", "math", "auto") and not is_import_path(reward):
            raise TaskError(f"task.reward: {reward!r} is not math or an import path module:function")
        # (scorer, setup) of the pool's scorers: math-verify, or the user's function by its import path
        self.scorer: tuple[str, tuple] = ("user", (reward,)) if is_import_path(reward) else ("math", ())

    def _problem(self, split: str, index: int) -> Problem:
        record = self.records[split][index]
        instruction = self.format.effective_instruction
        raw = f"{record.question}\n{instruction}\n" if instruction else f"{record.question}\n"
        return self.format.problem(f"{self.name}/{split}/{index}", record.question, raw, record.answer,
                                   {"source": record.where})

    def _order(self, seed: int, epoch: int) -> list[int]:
        order = list(range(len(self.records["train"])))
        random.Random(f"{self.name}:{seed}:{epoch}").shuffle(order)
        return order

    def stream_batch(self, index: int, n: int, seed: int) -> list[Problem]:
        """Training batch ``index`` of ``n`` problems: positions ``index*n .. index*n + n - 1`` of the train records
        in epochs, epoch ``e`` being their permutation by ``(seed, e)``: every record once per epoch."""
        size = len(self.records["train"])
        orders: dict[int, list[int]] = {}
        out = []
        for position in range(index * n, (index + 1) * n):
            epoch = position // size
            if epoch not in orders:
                orders[epoch] = self._order(seed, epoch)
            out.append(self._problem("train", orders[epoch][position % size]))
        return out

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        """``n`` train problems (:meth:`stream_batch` 0 of ``seed``: each record at most once while ``n`` is within
        the file), or the first ``min(n, size)`` eval records in file order (``seed`` does not change them)."""
        if split not in SPLITS:
            raise TaskError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
        if split == "train":
            return self.stream_batch(0, n, seed)
        return [self._problem("eval", i) for i in range(min(n, len(self.records["eval"])))]

    def score(self, problems: list[Problem], completions: list[str]) -> list[RewardOutcome]:
        """math-verify equivalence of each completion's final answer with its problem's (or the user's reward of it),
        in one sandboxed batch;
        a scorer that hangs past ``reward_timeout_s`` is killed and scores 0 as ``timeout``."""
        scorer, setup = self.scorer
        requests = [ScoreRequest(scorer, (p.answer,), c, setup) for p, c in zip(problems, completions, strict=True)]
        return shared_pool(self.reward_workers).score(requests, self.reward_timeout_s)

    def warm_up(self) -> None:
        """Start the scoring workers and import math-verify (or the user's reward) there, in the background."""
        shared_pool(self.reward_workers).warm_up([ScoreRequest(self.scorer[0], (), "", self.scorer[1])])

    def reward(self, problem: Problem, completion: str) -> float:
        """:meth:`score` of one completion."""
        return self.score([problem], [completion])[0].reward
