"""Wall-clock to a target held-out accuracy on the tool task: sync (k = 0), async at fixed bounds and async with
the adaptive bound (``async.max_staleness=auto``), side by side, over seeds.

Each run is ``vcpo train -c configs/tools.yaml`` from one cached warm start (``sft.seed=0`` for every RL seed) with
``async.mode``, ``async.max_staleness`` and ``seed`` set (and the given extra overrides); the sandbox runs every tool
call inside the rollout. Training time to a step is the sum of ``time/step_s - time/eval_s`` over the steps up to it
(evaluation, identical in every mode, left out). A finished run (its ``summary.json``) is read, not run again.

    python benchmarks/tools_async.py --target 0.82 --steps 40 --arms sync:0,async:2,async:auto --seeds 0 1 2 \
        --out runs/bench_tools trainer.eval_every=5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from vcpo.metrics import METRICS_FILE, read_metrics


def run(mode: str, k: str, seed: int, out: Path, steps: int, extra: list[str]) -> list[dict]:
    run_dir = out / f"{mode}_k{k}_s{seed}"
    if not (run_dir / "summary.json").exists():
        subprocess.run([sys.executable, "-m", "vcpo.cli", "train", "-c", "configs/tools.yaml", f"run_dir={run_dir}",
                        f"seed={seed}", "sft.seed=0", f"async.mode={mode}", f"async.max_staleness={k}",
                        f"trainer.max_steps={steps}", "logging.progress=false", *extra], check=True)
    return read_metrics(run_dir / METRICS_FILE)


def summarize(lines: list[dict], target: float) -> dict:
    """Training seconds to the first evaluation at or above ``target`` (None if never), and the run's means."""
    elapsed, reached = 0.0, None
    for m in lines:
        elapsed += m["time/step_s"] - m.get("time/eval_s", 0.0)
        if reached is None and m.get("eval/accuracy", -1.0) >= target:
            reached = {"step": m["step"], "train_s": round(elapsed, 1), "accuracy": m["eval/accuracy"]}
    evals = [m["eval/accuracy"] for m in lines if "eval/accuracy" in m]

    def mean(key: str) -> float:
        return round(sum(m[key] for m in lines) / len(lines), 3)

    return {"reached": reached, "train_s_total": round(elapsed, 1), "steps": len(lines),
            "accuracy_initial": lines[0].get("eval/accuracy_initial"), "accuracy_final": evals[-1] if evals else None,
            "ess_ratio_mean": mean("ess/ratio"), "staleness_mean": mean("staleness/mean"),
            "step_s_mean": round(elapsed / len(lines), 2), "calls_per_episode": mean("tools/calls_per_episode"),
            "turns_mean": mean("tools/turns_mean"), "masked_frac": mean("tools/masked_frac"),
            "staleness_bound_mean": mean("staleness/bound") if all("staleness/bound" in m for m in lines) else None}


def by_arm(runs: dict[int, dict]) -> dict:
    """An arm over its seeds: how many reached the target, and the mean and median training seconds of those."""
    times = [r["reached"]["train_s"] for r in runs.values() if r["reached"]]
    finals = [r["accuracy_final"] for r in runs.values() if r["accuracy_final"] is not None]
    return {"reached": f"{len(times)}/{len(runs)}",
            "train_s_to_target_mean": round(sum(times) / len(times), 1) if times else None,
            "train_s_to_target_median": round(statistics.median(times), 1) if times else None,
            "step_s_mean": round(sum(r["step_s_mean"] for r in runs.values()) / len(runs), 2),
            "accuracy_final_mean": round(sum(finals) / len(finals), 3) if finals else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, required=True, help="held-out accuracy to reach")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--arms", default="sync:0,async:2", help="mode:k pairs, k an integer or auto")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="RL seeds (one warm start for all)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_tools"))
    parser.add_argument("overrides", nargs="*", help="extra dotted overrides for every run")
    args = parser.parse_args()
    arms = [tuple(arm.split(":")) for arm in args.arms.split(",")]
    runs: dict[str, dict[int, dict]] = {f"{mode}_k{k}": {} for mode, k in arms}
    for seed in args.seeds:  # seed-major: a stopped benchmark has every arm on the seeds it finished
        for mode, k in arms:
            lines = run(mode, k, seed, args.out, args.steps, args.overrides)
            runs[f"{mode}_k{k}"][seed] = summarize(lines, args.target)
    results = {"target": args.target, "steps": args.steps, "seeds": args.seeds,
               "arms": {name: by_arm(per_seed) for name, per_seed in runs.items()}, "runs": runs}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
