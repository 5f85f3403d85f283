"""Wall-clock to a target held-out accuracy on the tool task, sync (k = 0) against async (k = 2), side by side.

Each run is ``vcpo train -c configs/tools.yaml`` from the same cached warm start with ``async.mode`` set (and the
given extra overrides); the sandbox runs every tool call inside the rollout. Training time to a step is the sum of
``time/step_s - time/eval_s`` over the steps up to it (evaluation, identical in both modes, left out).

    python benchmarks/tools_async.py --target 0.5 --steps 60 --out runs/bench_tools [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from vcpo.metrics import METRICS_FILE, read_metrics


def run(mode: str, k: int, out: Path, steps: int, extra: list[str]) -> list[dict]:
    run_dir = out / f"{mode}_k{k}"
    subprocess.run([sys.executable, "-m", "vcpo.cli", "train", "-c", "configs/tools.yaml", f"run_dir={run_dir}",
                    f"async.mode={mode}", f"async.max_staleness={k}", f"trainer.max_steps={steps}",
                    "logging.progress=false", *extra], check=True)
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
            "turns_mean": mean("tools/turns_mean"), "masked_frac": mean("tools/masked_frac")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, required=True, help="held-out accuracy to reach")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_tools"))
    parser.add_argument("overrides", nargs="*", help="extra dotted overrides for both runs")
    args = parser.parse_args()
    results = {f"{mode}_k{k}": summarize(run(mode, k, args.out, args.steps, args.overrides), args.target)
               for mode, k in (("sync", 0), ("async", 2))}
    sync, fast = results["sync_k0"]["reached"], results["async_k2"]["reached"]
    if sync and fast:
        results["speedup_sync_over_async"] = round(sync["train_s"] / fast["train_s"], 2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
