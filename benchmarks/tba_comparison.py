"""TBA (configs/tba.yaml) against asynchronous VCPO and GRPO on the embedded task, at one wall-clock budget.

Each run is `vcpo train` with `trainer.max_time_s=BUDGET` (the run stops after the first step that ends
past it, then evaluates) and an unreachable max_steps; the runs go one at a time, the arms' order rotated
per seed so that the machine's drift does not always favour the same arm. All three arms use the same
number of rollout worker processes (TBA's searchers). Reported per run: optimizer steps done, held-out
accuracy (warm start, last evaluation, mean of the last three), tokens generated (response tokens of the
groups the rollout source delivered to the learner; replay arms count each group once, when it arrived)
and tokens trained on, and the mean reward of freshly generated groups over the last 25 steps.

    python benchmarks/tba_comparison.py                        # 3 arms x seeds 0 1, 120 s each
    python benchmarks/tba_comparison.py --budget-s 30 --seeds 0 --out /tmp/tba   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from vcpo.metrics import METRICS_FILE, read_metrics

GRPO = ["objective.name=grpo", "advantage.estimator=grpo", "trainer.ess_lr.enabled=false"]
ARMS: dict[str, list[str]] = {
    "tba": ["-c", "configs/tba.yaml"],
    "vcpo": ["-c", "configs/quickstart.yaml"],
    "grpo": ["-c", "configs/quickstart.yaml", *GRPO],
}
"""Each arm's config file and overrides; the worker count is set for all of them by --workers."""


def run_arm(arm: str, seed: int, budget_s: float, workers: int, run_dir: Path) -> None:
    argv = [sys.executable, "-m", "vcpo.cli", "train", *ARMS[arm], f"seed={seed}", f"run_dir={run_dir}",
            f"async.num_workers={workers}", f"trainer.max_time_s={budget_s}", "trainer.max_steps=1000000",
            "trainer.eval_every=25", "trainer.checkpoint_every=0", "logging.progress=false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)


def summarize(run_dir: Path) -> dict[str, float]:
    lines = read_metrics(run_dir / METRICS_FILE)
    evals = [m["eval/accuracy"] for m in lines if "eval/accuracy" in m]
    trained = [m["response/length_mean"] * m["batch/size"] for m in lines]
    replay = "replay/fresh_tokens" in lines[0]
    generated = [m["replay/fresh_tokens"] for m in lines] if replay else trained
    fresh_reward = [m["replay/fresh_reward_mean" if replay else "reward/mean"] for m in lines[-25:]]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "steps": float(len(lines)), "wall_s": summary["wall_time_s"],
        "acc_initial": lines[0]["eval/accuracy_initial"], "acc_final": evals[-1],
        "acc_last3": statistics.fmean(evals[-3:]),
        "tokens_generated": float(sum(generated)), "tokens_trained": float(sum(trained)),
        "fresh_reward_last25": statistics.fmean(fresh_reward),
        "staleness_max": max(m["staleness/max"] for m in lines),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--workers", type=int, default=3, help="rollout worker processes of every arm")
    parser.add_argument("--out", type=Path, default=Path("runs/tba_comparison"))
    args = parser.parse_args()
    results = []
    for i, seed in enumerate(args.seeds):
        order = args.arms[i % len(args.arms):] + args.arms[:i % len(args.arms)]
        for arm in order:
            run_dir = args.out / f"{arm}_s{seed}"
            if not (run_dir / "summary.json").is_file():
                run_arm(arm, seed, args.budget_s, args.workers, run_dir)
            results.append({"arm": arm, "seed": seed} | summarize(run_dir))
            print(json.dumps(results[-1]), flush=True)
    (args.out / "results.json").write_text(json.dumps({
        "command": " ".join(sys.argv), "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(), "cpu_count": os.cpu_count(), "results": results}, indent=2))
    print("\n| arm | seed | steps | acc: start -> final (last 3) | tokens generated | tokens trained "
          "| fresh reward (last 25 steps) | max lag |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(results, key=lambda r: (args.arms.index(r["arm"]), r["seed"])):
        print(f"| {r['arm']} | {r['seed']} | {r['steps']:.0f} | {r['acc_initial']:.3f} -> {r['acc_final']:.3f} "
              f"({r['acc_last3']:.3f}) | {r['tokens_generated']:.0f} | {r['tokens_trained']:.0f} "
              f"| {r['fresh_reward_last25']:.3f} | {r['staleness_max']:.0f} |")


if __name__ == "__main__":
    main()
