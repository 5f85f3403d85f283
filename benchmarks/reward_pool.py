"""What the sandboxed scoring pool costs: the quickstart's per-step reward time before (in-process scorer) and
after (pool), and math-verify verifications per second with 2 workers.

    python benchmarks/reward_pool.py [--steps 30] [--pairs 200] [--gap-s 0.3]

Per step, the quickstart scores 16 prompts x 8 completions of reasoning-gym chain_sum; each arm waits ``--gap-s``
before its step, as scoring does in training (a quickstart step takes about 0.3 s), which is when the workers
fork their next scoring process. Arms, round-robin:
- in-process: the dataset's ``score_answer`` called in this process, the path before the pool (unsafe)
- pool, one batch: ``task.score`` of all 128 completions, one round trip per worker (what collect_groups does),
  with the quickstart's ``task.reward_workers`` (``--workers`` to change it)
- pool, one call each: ``task.reward`` 128 times (what an unbatched caller would pay)
Math: ``--pairs`` (completion, answer) pairs through ``math_rewards`` in one batch, and through ``math_reward``
from 2 threads at once (one verification per call, back to back: each call waits for the fork that the
previous one started), both on the default 2-worker pool.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

from vcpo.config import TaskConfig
from vcpo.rewards import math_reward, math_rewards, shared_pool
from vcpo.tasks import make_task


def quickstart_step(seed: int) -> tuple[list, list[str]]:
    """One step's problems and completions: each prompt 8 times, a third right, the rest near misses or junk."""
    task = make_task(TaskConfig())
    problems = [p for p in task.problems("train", 16, seed=seed) for _ in range(8)]
    rng = random.Random(seed)
    completions = []
    for p in problems:
        roll = rng.random()
        completions.append(p.answer if roll < 0.33 else str(int(p.answer) + rng.randint(1, 9)) if roll < 0.9
                           else rng.choice(["", "1+", "abc", "-"]))
    return problems, completions


def in_process(task, problems, completions) -> list[float]:
    scorer = task_scorer(task)
    return [min(max(float(scorer.score_answer(c.strip(), p.metadata["entry"])), 0.0), 1.0)
            for p, c in zip(problems, completions, strict=True)]


def task_scorer(task):
    import reasoning_gym

    return reasoning_gym.create_dataset(task.name, size=1, seed=0, **task.kwargs)


def math_pairs(n: int) -> list[tuple[str, str]]:
    forms = [
        (lambda a, b: (rf"so the answer is \boxed{{\frac{{{a}}}{{{b}}}}}", str(a / b))),
        (lambda a, b: (f"First {a} + {b} = {a + b}.\n#### {a + b}", str(a + b))),
        (lambda a, b: (f"The total is {a * b:,} dollars.", str(a * b))),
        (lambda a, b: (rf"\boxed{{x = {a - b}}}", str(a - b + (a % 2)))),  # every other one wrong
        (lambda a, b: (rf"\boxed{{\{{{a}, {b}\}}}}", rf"\{{{b},{a}\}}")),
    ]
    rng = random.Random(0)
    return [forms[i % len(forms)](rng.randint(1, 999), rng.randint(1, 999)) for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--gap-s", type=float, default=0.3)
    parser.add_argument("--workers", type=int, default=TaskConfig().reward_workers)
    args = parser.parse_args()
    task = make_task(TaskConfig(reward_workers=args.workers))
    task.reward(*quickstart_step(0)[0][:1], "1")  # start the workers
    time.sleep(1.0)
    arms = {"in-process (before)": in_process, "pool, one batch (after)": lambda t, p, c: t.score(p, c),
            "pool, one call each": lambda t, p, c: [t.reward(x, y) for x, y in zip(p, c, strict=True)]}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for step in range(args.steps):
        problems, completions = quickstart_step(step)
        reference = None
        for name, arm in arms.items():
            time.sleep(args.gap_s)
            start = time.perf_counter()
            out = arm(task, problems, completions)
            times[name].append(time.perf_counter() - start)
            rewards = [o if isinstance(o, float) else o.reward for o in out]
            assert reference is None or rewards == reference, f"{name} disagrees with the in-process scorer"
            reference = rewards
    base = statistics.median(times["in-process (before)"])
    print(f"quickstart step: 128 chain_sum completions, {task.reward_workers} worker(s) (task.reward_workers), "
          f"{args.gap_s} s between steps")
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"  {name:26s} median {median * 1e3:8.2f} ms   p90 {statistics.quantiles(ts, n=10)[-1] * 1e3:8.2f} ms"
              f"   {median / base:7.1f}x in-process")

    pairs = math_pairs(args.pairs)
    completions, answers = [c for c, _ in pairs], [a for _, a in pairs]
    math_rewards(completions[:4], answers[:4])
    start = time.perf_counter()
    outcomes = math_rewards(completions, answers)
    batched = len(pairs) / (time.perf_counter() - start)
    rewards: list[float] = [0.0] * len(pairs)

    def verify(offset: int) -> None:
        for i in range(offset, len(pairs), 2):
            rewards[i] = math_reward(completions[i], answers[i])

    threads = [threading.Thread(target=verify, args=(k,)) for k in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    single = len(pairs) / (time.perf_counter() - start)
    assert rewards == [o.reward for o in outcomes]
    print(f"math-verify, {shared_pool().workers} workers, {len(pairs)} pairs ({sum(rewards):.0f} equivalent): "
          f"{batched:.0f} verifications/s batched, {single:.0f}/s one per call from 2 threads")
    print("pool counts:", shared_pool().counts())


if __name__ == "__main__":
    main()
