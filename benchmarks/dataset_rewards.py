"""Verification throughput through the dataset path: a GSM8K-format JSONL file read by ``task.name: jsonl``, its
completions scored by ``DatasetTask.score`` (math-verify in the sandboxed pool, 2 workers), side by side with the
same (completion, answer) pairs sent as ``math_rewards`` sends them, on the same pool, round-robin in one run.

    python benchmarks/dataset_rewards.py [--records 256] [--repeats 5] [--workers 2]

Completions are reasoning text of a few sentences ending in ``\\boxed{x}``, ``#### x`` or a bare last number, half of
them wrong; each record's reference is the text after ``####`` of a GSM8K-style answer field.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from vcpo.config import TaskConfig
from vcpo.rewards import ScoreRequest, shared_pool
from vcpo.tasks import make_task


def write_gsm8k(path: Path, n: int, rng: random.Random) -> None:
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        total = (a + b) * c
        rows.append({"question": f"Sam has {a} marbles and finds {b}. He then has {c} times as many bags. How many?",
                     "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n{a + b} * {c} = {total}\n#### {total:,}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def completion(answer: str, rng: random.Random) -> str:
    value = int(answer) + (0 if rng.random() < 0.5 else rng.randint(1, 9))
    reasoning = "First add the marbles, then multiply by the number of bags. "
    return reasoning + rng.choice([f"So the answer is \\boxed{{{value}}}.", f"#### {value}", f"That gives {value:,}."])


def math_requests(completions: list[str], answers: list[str]) -> list[ScoreRequest]:
    """The requests ``math_rewards`` sends for these pairs."""
    return [ScoreRequest("math", (a,), c) for c, a in zip(completions, answers, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gsm8k.jsonl"
        write_gsm8k(path, args.records, rng)
        task = make_task(TaskConfig(name="jsonl", kwargs={"train_path": str(path), "eval_path": str(path)},
                                    reward_workers=args.workers))
        problems = task.problems("eval", args.records, seed=0)
        completions = [completion(p.answer, rng) for p in problems]
        answers = [p.answer for p in problems]
        pool = shared_pool(args.workers)
        task.score(problems[:8], completions[:8])  # start the workers and import math-verify before timing
        rates: dict[str, list[float]] = {"dataset path (DatasetTask.score)": [], "direct math requests": []}
        rewards = {}
        for _ in range(args.repeats):
            for arm in rates:
                start = time.perf_counter()
                if arm.startswith("dataset"):
                    outcomes = task.score(problems, completions)
                else:  # math_rewards' own requests, on the same pool (math_rewards itself uses the 2-worker pool)
                    outcomes = pool.score(math_requests(completions, answers), task.reward_timeout_s)
                rates[arm].append(len(problems) / (time.perf_counter() - start))
                rewards[arm] = [o.reward for o in outcomes]
        same = rewards["dataset path (DatasetTask.score)"] == rewards["direct math requests"]
        print(f"{args.records} GSM8K-format records, {args.workers} workers, {args.repeats} rounds, "
              f"load {os.getloadavg()[0]:.1f}; rewards identical across arms: {same}; "
              f"mean reward {statistics.mean(rewards['direct math requests']):.3f}; counts {pool.counts()}")
        for arm, values in rates.items():
            print(f"  {arm:34s} median {statistics.median(values):7.1f} verifications/s "
                  f"(min {min(values):.1f}, max {max(values):.1f})")
        ratio = statistics.median(rates["dataset path (DatasetTask.score)"]) / statistics.median(
            rates["direct math requests"])
        print(f"  ratio dataset path / direct: {ratio:.2f}")


if __name__ == "__main__":
    main()
