"""Dynamic sampling against none (issue 45, item 1): `rollout.filter: zero_variance` (drop groups whose rewards are
all equal, refill up to `rollout.filter_max_factor`) against no filter, on the quickstart sums and the tool task,
over seeds, lagged (deterministic: a rerun gives the same numbers), with the same warm start per setting.

Per setting and arm it prints held-out accuracy at each evaluation (mean [95% t-interval] over seeds), the late
accuracy (mean of the last two evaluations), the training seconds (the sum of `time/step_s` less evaluation time),
the groups generated per trained group, and the paired differences (filter minus none, same seed): late accuracy per
step, and accuracy per second (the filtered run's accuracy at its last evaluation within the unfiltered run's
training seconds). Each run is `vcpo train` in its own directory under OUT; finished runs are kept (rerun to resume).

    python benchmarks/dynamic_sampling.py --seeds 0 1 2 --out runs/dynamic_sampling
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from vcpo.metrics import METRICS_FILE, read_metrics  # noqa: E402
from vcpo.study.stats import paired_difference, t_interval  # noqa: E402

SETTINGS: dict[str, list[str]] = {
    # the embedded model warm-started on 2-term sums (cached SFT), 100 lagged steps at k = 2
    "quickstart": ["-c", "configs/quickstart.yaml", "async.mode=lagged", "async.max_staleness=2",
                   "trainer.max_steps=100", "trainer.eval_every=20", "trainer.checkpoint_every=0"],
    # the tool task from its pinned warm start w0 (held-out 0.660), 40 lagged steps at k = 2
    "tools": ["-c", "configs/tools.yaml", "model.path=benchmarks/staleness/warm_starts_tools/w0",
              "async.mode=lagged", "async.max_staleness=2", "trainer.max_steps=40", "trainer.eval_every=10",
              "trainer.checkpoint_every=0"],
}
ARMS = {"none": ["rollout.filter=none"], "filter": ["rollout.filter=zero_variance"]}


def run(setting: str, arm: str, seed: int, out: Path) -> Path:
    run_dir = out / f"{setting}_{arm}_s{seed}"
    if (run_dir / "summary.json").is_file():
        return run_dir
    argv = [sys.executable, "-m", "vcpo.cli", "train", *SETTINGS[setting], *ARMS[arm], f"seed={seed}",
            f"run_dir={run_dir}", "logging.progress=false"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    with open(out / f"{run_dir.name}.log", "w") as log:
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return run_dir


def read(run_dir: Path) -> dict:
    """Evaluations by step, cumulative training seconds at each step, groups generated per trained group."""
    evals, seconds, total, per_trained = {}, {}, 0.0, []
    for m in read_metrics(run_dir / METRICS_FILE):
        if "time/step_s" in m:
            total += m["time/step_s"] - m.get("time/eval_s", 0.0)
            seconds[m["step"]] = total
            per_trained.append(m.get("filter/groups_per_trained", 1.0))
        if "eval/accuracy" in m:
            evals[m["step"]] = m["eval/accuracy"]
    return {"evals": evals, "seconds": seconds, "total_s": total, "per_trained": statistics.fmean(per_trained)}


def late(r: dict) -> float:
    return statistics.fmean([v for _, v in sorted(r["evals"].items())][-2:])


def at_seconds(r: dict, budget: float) -> float:
    """Accuracy at the last evaluation reached within ``budget`` training seconds (the first one otherwise)."""
    reached = [v for step, v in sorted(r["evals"].items()) if r["seconds"].get(step, 0.0) <= budget]
    return reached[-1] if reached else min(r["evals"].items())[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", type=Path, default=Path("runs/dynamic_sampling"))
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    for setting in args.settings:
        results = {arm: {s: read(run(setting, arm, s, args.out)) for s in args.seeds} for arm in ARMS}
        print(f"\n## {setting} ({len(args.seeds)} seeds)\n")
        steps = sorted(results["none"][args.seeds[0]]["evals"])
        print("| step | " + " | ".join(ARMS) + " |\n|---|" + "---|" * len(ARMS))
        for step in steps:
            cells = [str(t_interval([results[a][s]["evals"][step] for s in args.seeds])) for a in ARMS]
            print(f"| {step} | " + " | ".join(cells) + " |")
        for arm in ARMS:
            r = results[arm].values()
            print(f"{arm}: late accuracy {t_interval([late(x) for x in r])}, training seconds "
                  f"{statistics.fmean(x['total_s'] for x in r):.0f}, groups generated per trained group "
                  f"{statistics.fmean(x['per_trained'] for x in r):.2f}")
        none, filt = results["none"], results["filter"]
        print("filter minus none, late accuracy (same steps):",
              paired_difference({s: late(filt[s]) for s in args.seeds}, {s: late(none[s]) for s in args.seeds}))
        print("filter minus none, accuracy within the unfiltered run's training seconds:",
              paired_difference({s: at_seconds(filt[s], none[s]["total_s"]) for s in args.seeds},
                                {s: at_seconds(none[s], none[s]["total_s"]) for s in args.seeds}))
        print("seconds ratio filter / none:",
              t_interval([filt[s]["total_s"] / none[s]["total_s"] for s in args.seeds]))


if __name__ == "__main__":
    main()
