"""Length and difficulty bias of the staleness bound (issue 45, item 2): does async mode train on the groups it
generated, or on the short and easy ones? Run by hand, not in CI.

Each run is ``vcpo train -c configs/tools.yaml`` from the pinned tool-task warm start, in async mode with two rollout
workers, with the tool task wrapped by :func:`straggling_tools`: before each environment turn the worker pauses a
random time uniform in [0, jitter_s] (the random delays of the Ray rollout actor's ``jitter_s``, here per turn, so
that an episode that calls the tool and answers later waits more). Arms: without and with ``async.drop_older_than``.
Per run, from ``metrics.jsonl`` (the ``groups/*`` metrics) and ``trained_groups.jsonl``: generated, trained and
dropped groups' mean length and pass rate, the per-step difference trained - generated with a 95% t interval over
steps, and the lag (step - 1 - version) of the trained groups above and below the run's median length. Per arm: the
same pooled over seeds, and the t interval of the per-run mean differences over seeds. A finished run is read, not
run again.

    nice -n 10 python benchmarks/length_bias.py --steps 20 --seeds 0 1 2 --out runs/length_bias
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from vcpo.metrics import METRICS_FILE, read_metrics
from vcpo.study.bias import KINDS, bias_figures, group_counts
from vcpo.study.stats import t_interval
from vcpo.tasks.tool_task import ToolTask
from vcpo.train.run_dir import TRAINED_GROUPS_FILE

ROOT = Path(__file__).resolve().parents[1]
WARM_START = "benchmarks/staleness/warm_starts_tools/w0"


class StragglingToolTask(ToolTask):
    """The tool task with a random pause, uniform in [0, jitter_s], before each environment turn of a batch."""

    def __init__(self, jitter_s: float, **kwargs: Any) -> None:
        super().__init__("tools:products", **kwargs)
        self.jitter_s = float(jitter_s)
        self.rng = random.Random()

    def step(self, tokenizer: Any, problems: list, turn_ids: list[list[int]], turn_index: int) -> list:
        time.sleep(self.rng.uniform(0.0, self.jitter_s))
        return super().step(tokenizer, problems, turn_ids, turn_index)


def straggling_tools(jitter_s: float = 0.0, **kwargs: Any) -> StragglingToolTask:
    """``task.name: benchmarks.length_bias:straggling_tools``: configs/tools.yaml's task (a new task.name on the
    command line drops the file's task.kwargs, so they are read here), ``kwargs`` over them, and ``jitter_s``."""
    tools = yaml.safe_load((ROOT / "configs" / "tools.yaml").read_text())["task"]["kwargs"]
    return StragglingToolTask(jitter_s, **{**tools, **kwargs})


def run(arm: str, alpha: str, seed: int, out: Path, args: argparse.Namespace) -> Path:
    run_dir = out / f"{arm}_s{seed}"
    if not (run_dir / "summary.json").exists():
        subprocess.run([sys.executable, "-m", "vcpo.cli", "train", "-c", "configs/tools.yaml", f"run_dir={run_dir}",
                        f"seed={seed}", f"model.path={WARM_START}", "task.name=benchmarks.length_bias:straggling_tools",
                        f"task.kwargs.jitter_s={args.jitter_s}", "async.mode=async",
                        f"async.max_staleness={args.k}", f"async.drop_older_than={alpha}",
                        f"async.num_workers={args.workers}", *args.extra,
                        f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
                        f"task.eval_size={args.eval_size}", "trainer.checkpoint_every=0", "logging.progress=false"],
                       check=True)
    return run_dir


def lag_by_length(run_dir: Path) -> dict[str, float] | None:
    """Mean lag of the trained groups at or below, and above, the run's median trained length."""
    path = run_dir / TRAINED_GROUPS_FILE
    if not path.is_file():
        return None
    groups = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    median = statistics.median(g["length_mean"] for g in groups)
    short = [g["step"] - 1 - g["version"] for g in groups if g["length_mean"] <= median]
    long = [g["step"] - 1 - g["version"] for g in groups if g["length_mean"] > median]
    return {"lag_short": statistics.fmean(short), "lag_long": statistics.fmean(long) if long else float("nan")}


def summarize(run_dir: Path) -> dict[str, Any]:
    records = read_metrics(run_dir / METRICS_FILE)
    out: dict[str, Any] = {"counts": group_counts(records), "differences": {}}
    for f in bias_figures(records):
        out[f.figure] = {k: (round(v, 4) if v is not None else None) for k, v in f.level.items()}
        out["differences"][f.figure] = f.differences
    out["lag"] = lag_by_length(run_dir)
    out["wall_s"] = json.loads((run_dir / "summary.json").read_text())["wall_time_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--k", type=int, default=2, help="async.max_staleness")
    parser.add_argument("--alpha", default="1", help="async.drop_older_than of the dropping arm")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--jitter-s", type=float, default=0.5, help="the largest random pause per environment turn")
    parser.add_argument("--eval-size", type=int, default=20)
    parser.add_argument("--arms", default="bound_only,drop_older_than", help="which of the two arms to run")
    parser.add_argument("--out", type=Path, default=Path("runs/length_bias"))
    parser.add_argument("--prefix", default="", help="put before every arm's name (runs with other --extra)")
    parser.add_argument("extra", nargs="*", help="further config overrides for every run (key=value)")
    args = parser.parse_args()
    prefix = args.prefix
    arms = {f"{prefix}{arm}" + (f"_{args.alpha}" if arm == "drop_older_than" else ""):
            args.alpha if arm == "drop_older_than" else "null" for arm in args.arms.split(",")}
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "arms": {}}
    for arm, alpha in arms.items():
        runs = {seed: summarize(run(arm, alpha, seed, args.out, args)) for seed in args.seeds}
        arm_out: dict[str, Any] = {"runs": runs}
        for figure in ("length_mean", "pass_rate"):
            pooled = [d for r in runs.values() for d in r["differences"][figure]]
            per_run = [statistics.fmean(r["differences"][figure]) for r in runs.values()]
            levels = {kind: statistics.fmean(r[figure][kind] for r in runs.values() if r[figure][kind] is not None)
                      if any(r[figure][kind] is not None for r in runs.values()) else None
                      for kind in KINDS}
            arm_out[figure] = {"levels": levels, "diff_over_steps": str(t_interval(pooled)),
                               "diff_over_seeds": str(t_interval(per_run))}
        counts = [r["counts"] for r in runs.values()]
        arm_out["dropped_frac"] = sum(c["dropped"] for c in counts) / sum(c["generated"] for c in counts)
        lags = [r["lag"] for r in runs.values() if r["lag"]]
        arm_out["lag_short_long"] = (statistics.fmean(x["lag_short"] for x in lags),
                                     statistics.fmean(x["lag_long"] for x in lags)) if lags else None
        results["arms"][arm] = arm_out
        print(f"\n{arm} (async.drop_older_than={alpha}, k={args.k}, {len(runs)} seeds x {args.steps} steps): "
              f"{arm_out['dropped_frac']:.1%} of generated groups dropped; trained-group lag short/long "
              f"{arm_out['lag_short_long']}")
        for figure in ("length_mean", "pass_rate"):
            f = arm_out[figure]
            dropped = f["levels"]["dropped"]
            print(f"  {figure}: generated {f['levels']['generated']:.3f}, trained {f['levels']['trained']:.3f}, "
                  f"dropped {'-' if dropped is None else f'{dropped:.3f}'}; "
                  f"trained - generated {f['diff_over_steps']} over steps, {f['diff_over_seeds']} over seeds")
    (args.out / f"{prefix}length_bias.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
