"""Time to synchronous accuracy on the tool task, the VCPO paper's unit: for each arm, the training seconds until
held-out accuracy first reaches synchronous GRPO's late accuracy, from real runs on this machine and from a model.

Real runs. ``vcpo train -c configs/tools.yaml`` from one pinned warm start (``model.path``) with an arm's overrides
(the study grids' ``ARMS``), ``async.mode=async`` at bound k with N rollout workers (``sync`` for k = 0), a
checkpoint every ``--every`` steps (all kept) and no evaluation inside the run: in async mode the workers go on
generating while the learner evaluates, which would hand the next steps rollouts for free. Each checkpoint is then
evaluated here (greedy, the run's own held-out problems, as the trainer does). Training seconds to step s: the sum
of ``time/step_s`` (less ``time/eval_s``, only the last step has one) over steps 1..s; the first step, which waits
for the workers to load the model, is counted at the run's median step time.

The model. time(arm, k) = steps(arm, k) x step_s(arm), where steps(arm, k) is when a lagged study's cells (every
batch exactly k steps stale) first reach the target, per seed, and step_s(arm) the real async run's measured seconds
per step. A real async run's staleness is at most its bound and often far less (on a small machine the workers cannot
get far ahead of the learner), so the model is given at every k of the study ("what if every batch were k stale, at
this machine's step time") and checked, seed by seed, at the staleness the real run actually saw: the smallest study
k at or above the run's largest staleness, an upper bound on the lag of every batch it trained on.

Target: synchronous GRPO's late accuracy (the mean of its last three evaluations) in the study cell of the same seed
(the same held-out problems and warm start). A crossing between two evaluations is placed by linear interpolation.

    python benchmarks/time_to_accuracy.py --study benchmarks/staleness/study3/cells \\
        --warm-start benchmarks/staleness/warm_starts_tools/w0 --arms grpo,vcpo,vcpo_gonly,vcpo_gonly_proxy,vespo \\
        --bounds 16 --workers 2 --steps 40 --every 10 --seeds 0 1 2 --out runs/time_to_accuracy \\
        --json benchmarks/staleness/time_to_accuracy/results.json

Runs already finished (``summary.json``) and checkpoints already evaluated (``eval_greedy.json``) are read, not redone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from vcpo.metrics import METRICS_FILE, read_metrics
from vcpo.study.collapse import eval_series
from vcpo.study.grids import ARMS
from vcpo.study.report import summarize_cell
from vcpo.study.stats import paired_difference

REPO = Path(__file__).resolve().parents[1]


def crossing(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first (fractional) step at which the piecewise-linear ``curve`` of (step, accuracy) reaches ``target``."""
    for (s0, a0), (s1, a1) in itertools.pairwise(curve):
        if a0 >= target:
            return s0
        if a1 >= target:
            return s0 + (target - a0) / (a1 - a0) * (s1 - s0)
    return curve[-1][0] if curve and curve[-1][1] >= target else None


def cell_curve(cell: Path) -> list[tuple[float, float]]:
    """A study cell's held-out accuracy curve: (0, before RL), then each evaluation."""
    steps, accuracies = eval_series(read_metrics(cell / METRICS_FILE))
    return [(float(s), a) for s, a in zip(steps, accuracies, strict=True)]


class Study(NamedTuple):
    """A lagged study's cells directory and the warm start whose cells (``ARM_kK_WS_sSEED``) are read."""

    cells: Path
    warm_start: str


def study_ks(study: Study, arm: str) -> list[int]:
    """The lags at which the study has cells of ``arm``."""
    found = study.cells.glob(f"{arm}_k[0-9]*_{study.warm_start}_s*")
    return sorted({int(c.name.removeprefix(f"{arm}_k").split("_")[0]) for c in found})


def study_cells(study: Study, arm: str, k: int) -> dict[int, Path]:
    """The cells of ``arm`` at lag ``k`` by seed."""
    return {int(cell.name.rsplit("_s", 1)[1]): cell
            for cell in sorted(study.cells.glob(f"{arm}_k{k}_{study.warm_start}_s*"))}


def sync_target(study: Study, seed: int) -> float:
    """Synchronous GRPO's late accuracy (as `vcpo report` has it) in the study cell of ``seed``."""
    cells = study_cells(study, "grpo", 0)
    if seed not in cells:
        raise SystemExit(f"{study.cells} has no synchronous GRPO cell of warm start {study.warm_start} for seed "
                         f"{seed}: no target")
    return summarize_cell(cells[seed])["late_accuracy"]


def run_name(arm: str, k: int, workers: int, seed: int) -> str:
    return f"{arm}_sync_s{seed}" if k == 0 else f"{arm}_async_k{k}_n{workers}_s{seed}"


def train(arm: str, k: int, workers: int, seed: int, args: argparse.Namespace) -> Path:
    run_dir = args.out / run_name(arm, k, workers, seed)
    if not (run_dir / "summary.json").exists():
        timing = ["async.mode=sync"] if k == 0 else [
            "async.mode=async", f"async.max_staleness={k}", f"async.num_workers={workers}"]
        subprocess.run([sys.executable, "-m", "vcpo.cli", "train", "-c", str(REPO / "configs/tools.yaml"),
                        f"run_dir={run_dir}", f"model.path={args.warm_start}", f"seed={seed}", *ARMS[arm], *timing,
                        f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
                        f"trainer.checkpoint_every={args.every}", "trainer.keep_checkpoints=null",
                        f"task.eval_size={args.eval_size}",
                        "logging.progress=false", *args.overrides], check=True, cwd=REPO)
    return run_dir


def checkpoint_curve(run_dir: Path, initial: float) -> list[tuple[float, float]]:
    """Greedy held-out accuracy of each of the run's checkpoints (evaluated once, cached beside each)."""
    from vcpo.config import load_config
    from vcpo.train.eval_report import run_eval
    from vcpo.train.evaluate import EvalSettings

    config = load_config(run_dir / "config.yaml", [])
    settings = EvalSettings(config.rollout.max_new_tokens, 0, 1.0, 1.0, seed=config.seed,
                            lm_head_fp32=config.model.lm_head_fp32)
    curve = [(0.0, initial)]
    for ckpt in sorted((run_dir / "checkpoints").glob("step_[0-9]*[0-9]")):
        cached = ckpt / "eval_greedy.json"
        if not cached.exists():
            report = run_eval(config, ckpt, [], settings)
            cached.write_text(json.dumps(report, indent=2) + "\n")
        accuracy = json.loads(cached.read_text())["datasets"][config.task.name]["accuracy"]
        curve.append((float(ckpt.name.removeprefix("step_")), accuracy))
    return curve


def real_run(run_dir: Path, target: float) -> dict:
    """A real run's step time, staleness, ESS, accuracy curve and measured time to ``target``."""
    lines = read_metrics(run_dir / METRICS_FILE)
    step_s = [m["time/step_s"] - m.get("time/eval_s", 0.0) for m in lines]
    median = statistics.median(step_s[1:])
    step_s[0] = median  # step 1 waits for the workers to load the model and the scorer: not a training step
    cumulative = [0.0]
    for s in step_s:
        cumulative.append(cumulative[-1] + s)
    curve = checkpoint_curve(run_dir, lines[0]["eval/accuracy_initial"])
    step = crossing(curve, target)
    measured = None
    if step is not None:  # seconds at a fractional step: linear between the whole steps around it
        lo = int(step)
        measured = cumulative[lo] + (step - lo) * (cumulative[min(lo + 1, len(step_s))] - cumulative[lo])
    in_run = [m["eval/accuracy"] for m in lines if "eval/accuracy" in m]
    return {"steps": len(lines), "step_s_mean": cumulative[-1] / len(step_s), "step_s_median": median,
            "first_step_s": lines[0]["time/step_s"],
            "staleness_mean": statistics.fmean(m["staleness/mean"] for m in lines),
            "staleness_max": max(m["staleness/max"] for m in lines),
            "ess_ratio_mean": statistics.fmean(m["ess/ratio"] for m in lines),
            "rollout_wait_s_mean": statistics.fmean(m["time/rollout_wait_s"] for m in lines),
            "curve": curve, "final_in_run_eval": in_run[-1] if in_run else None,
            "steps_to_target": step, "seconds_to_target": measured}


def lagged(study: Study, arm: str, k: int) -> dict[int, float | None]:
    """Steps to each seed's target in the study's lagged cells of ``arm`` at ``k``, by seed."""
    return {seed: crossing(cell_curve(cell), sync_target(study, seed))
            for seed, cell in study_cells(study, arm, k).items()}


def mean_of(values: list[float | None]) -> float | None:
    """The mean of the values that are not None (None when none is)."""
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def summarize(study: Study, arm: str, k: int, runs: dict[int, dict]) -> dict:
    """One arm at one bound over the seeds: the real runs, the model at every study k, and the model checked seed by
    seed at the staleness each run saw.

    model seconds at k = the mean of the lagged steps to target over the study seeds that reached it x the arm's mean
    seconds per step; check (seed s) = lagged steps (seed s, k seen) x that run's seconds per step, against the
    seconds it took."""
    step_s = statistics.fmean(r["step_s_mean"] for r in runs.values())
    ks = study_ks(study, arm)
    steps = {lag: lagged(study, arm, lag) for lag in ks}
    model = {lag: None if mean_of(list(by_seed.values())) is None else mean_of(list(by_seed.values())) * step_s
             for lag, by_seed in steps.items()}
    checks = {}
    for seed, r in runs.items():
        seen = next((lag for lag in ks if lag >= r["staleness_max"]), None)
        lag_steps = None if seen is None else steps[seen].get(seed)
        checks[seed] = {"k_seen": seen, "real_s": r["seconds_to_target"],
                        "model_s": None if lag_steps is None else lag_steps * r["step_s_mean"]}
    return {"arm": arm, "k": k, "seeds": sorted(runs), "step_s_mean": step_s,
            "staleness_mean": statistics.fmean(r["staleness_mean"] for r in runs.values()),
            "staleness_max": max(r["staleness_max"] for r in runs.values()),
            "ess_ratio_mean": statistics.fmean(r["ess_ratio_mean"] for r in runs.values()),
            "real_reached": sum(r["seconds_to_target"] is not None for r in runs.values()),
            "real_seconds_mean": mean_of([r["seconds_to_target"] for r in runs.values()]),
            "lagged_steps": steps, "model_seconds": model, "checks": checks, "runs": runs}


def fmt(x: float | None, digits: int = 0) -> str:
    return "never" if x is None else f"{x:.{digits}f}"


def speedup(base: float | None, seconds: float | None) -> str:
    return "-" if seconds is None or base is None else f"{base / seconds:.2f}x"


def measured_table(rows: list[dict]) -> str:
    """The real runs, each arm against real synchronous GRPO (the first row), and the model's check."""
    base = rows[0]["real_seconds_mean"]

    def reached(r: dict) -> dict[int, float]:
        return {seed: c["real_s"] for seed, c in r["checks"].items() if c["real_s"] is not None}

    def paired(r: dict) -> str:
        diff = paired_difference(reached(r), reached(rows[0]))
        return "-" if diff is None or r is rows[0] else f"{diff.mean:+.0f} [{diff.low:+.0f}, {diff.high:+.0f}]"

    def check(r: dict) -> str:
        parts = []
        for seed, c in sorted(r["checks"].items()):
            ratio = "-" if c["real_s"] is None or c["model_s"] is None else f"{c['model_s'] / c['real_s']:.2f}"
            parts.append(f"s{seed} k{c['k_seen']}: {fmt(c['model_s'])} / {fmt(c['real_s'])} ({ratio})")
        return "; ".join(parts)

    head = ("| arm | bound k | staleness seen (mean / max) | ESS ratio | s per step | s to target (runs reached) "
            "| vs sync GRPO | minus sync GRPO's s, paired [95% t] | check per seed: model at k seen / real s (ratio) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        out.append(f"| {r['arm']} | {r['k'] or 'sync'} | {r['staleness_mean']:.2f} / {r['staleness_max']:.0f} "
                   f"| {r['ess_ratio_mean']:.2f} | {r['step_s_mean']:.2f} | {fmt(r['real_seconds_mean'])} "
                   f"({r['real_reached']}/{len(r['seeds'])}) | {speedup(base, r['real_seconds_mean'])} | {paired(r)} "
                   f"| {check(r)} |")
    return "\n".join(out)


def check_summary(rows: list[dict]) -> str:
    """The model's checks pooled over arms and seeds: model / real seconds where both reached the target, and the
    runs that only one of them says reach it."""
    pairs = [c for r in rows for c in r["checks"].values()]
    ratios = sorted(c["model_s"] / c["real_s"] for c in pairs if c["real_s"] is not None and c["model_s"] is not None)
    one_sided = [c for c in pairs if (c["real_s"] is None) != (c["model_s"] is None)]
    if not ratios:
        return f"check: no run that both the model and the real run say reaches the target ({len(pairs)} runs)"
    close = sum(2 / 3 <= x <= 3 / 2 for x in ratios)
    return (f"check: model / real seconds over {len(ratios)} runs: median {statistics.median(ratios):.2f}, range "
            f"{ratios[0]:.2f}-{ratios[-1]:.2f}, {close} of {len(ratios)} within 1.5x; "
            f"{len(one_sided)} run(s) reach the target on one side only")


def model_table(rows: list[dict]) -> str:
    """The model at each study k: seconds to target (study seeds that reached it) and speed-up over the model's
    synchronous GRPO (lagged k = 0 steps x real synchronous seconds per step)."""
    base = rows[0]["model_seconds"].get(0)
    ks = sorted({lag for r in rows[1:] for lag in r["model_seconds"]})
    head = "| arm (async s per step) | " + " | ".join(f"k = {lag}" for lag in ks) + " |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows[1:]:
        cells = []
        for lag in ks:
            seconds, reached = r["model_seconds"].get(lag), r["lagged_steps"].get(lag, {})
            n = f"{sum(v is not None for v in reached.values())}/{len(reached)}"
            cells.append(f"never ({n})" if seconds is None else f"{seconds:.0f} s, {speedup(base, seconds)} ({n})")
        out.append(f"| {r['arm']} ({r['step_s_mean']:.2f}) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", type=Path, required=True, help="a lagged study's cells directory")
    parser.add_argument("--warm-start", type=Path, required=True, help="the study's warm-start model directory")
    parser.add_argument("--warm-start-id", default="w0", help="its id in the study's cell names")
    parser.add_argument("--arms", default="grpo,vcpo,vcpo_gonly,vcpo_gonly_proxy,vespo")
    parser.add_argument("--bounds", default="16", help="async bounds k (comma-separated); sync GRPO always runs")
    parser.add_argument("--workers", type=int, default=2, help="rollout worker processes of the async runs")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints (evaluated afterwards)")
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="RL seeds (the warm start is shared)")
    parser.add_argument("--out", type=Path, default=Path("runs/time_to_accuracy"))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("overrides", nargs="*", help="extra dotted overrides for every run")
    args = parser.parse_args()
    args.out, args.warm_start = args.out.resolve(), args.warm_start.resolve()
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}")
    study = Study(args.study, args.warm_start_id)
    plan = [("grpo", 0)] + [(arm, int(k)) for k in args.bounds.split(",") for arm in args.arms.split(",")]
    targets = {seed: sync_target(study, seed) for seed in args.seeds}
    runs: dict[tuple[str, int], dict[int, dict]] = {cell: {} for cell in plan}
    for seed in args.seeds:  # seed-major: a stopped benchmark has every arm on the seeds it finished
        for arm, k in plan:
            runs[arm, k][seed] = real_run(train(arm, k, args.workers, seed, args), targets[seed])
    rows = [summarize(study, arm, k, runs[arm, k]) for arm, k in plan]
    results = {"targets": targets, "seeds": args.seeds, "workers": args.workers, "steps": args.steps,
               "every": args.every, "study": str(args.study), "warm_start": str(args.warm_start),
               "warm_start_id": args.warm_start_id, "overrides": args.overrides, "rows": rows,
               "measured": measured_table(rows), "check": check_summary(rows), "model": model_table(rows)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print("\n\n".join(results[key] for key in ("measured", "check", "model")))


if __name__ == "__main__":
    main()
