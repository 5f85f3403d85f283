"""`vcpo report SWEEP_DIR`: REPORT.md (per-cell and aggregate tables, early-warning evaluation, claims
checked against the data) and PNG figures, read only from the cells' metrics.jsonl, summary.json and
config.yaml (plus sweep.json for the command).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from vcpo.metrics import read_metrics
from vcpo.study.collapse import (
    COLLAPSE_FRACTION,
    EarlyWarning,
    collapse_point,
    eval_series,
    evaluate_warnings,
    warning_steps,
)

REPORT_FILE = "REPORT.md"
CELL_NAME = re.compile(r"^(?P<arm>.+)_k(?P<k>\d+)_s(?P<seed>\d+)$")
BASELINES = ("grpo", "tis_seq", "icepop", "m2po", "vespo", "gspo")
LATE_EVALS = 3
"""Late accuracy: the mean of a run's last LATE_EVALS held-out evaluations. One 200-problem evaluation has a
binomial standard error of about 0.03, as large as the differences in question; the mean of three (and of the
seeds) is what the aggregate tables, the accuracy-vs-k figure and claim (c) use. Final and best are per cell."""
LATE_REWARD_STEPS = 50
MATCH_TOLERANCE = 0.05
"""Claim (c): "matches synchronous accuracy" means within this absolute accuracy of the k=0 run; about two
binomial standard errors of a 200-problem evaluation at accuracy 0.3 (2 x sqrt(0.21 / 200) = 0.065)."""


class ReportError(Exception):
    """Nothing to report (no sweep directory, no finished cell); the message is one line naming it."""


def summarize_cell(run_dir: Path) -> dict[str, Any]:
    """A finished cell's key numbers: accuracies, collapse step, warnings, mean ESS ratio, wall time."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_metrics(run_dir / "metrics.jsonl")
    steps, accs = eval_series(records)
    ess = [r["ess/ratio"] for r in records if isinstance(r.get("ess/ratio"), int | float)]
    rewards = [r["reward/mean"] for r in records if isinstance(r.get("reward/mean"), int | float)]
    learner_s = [r["time/learner_s"] for r in records if isinstance(r.get("time/learner_s"), int | float)]
    warnings = warning_steps(records)
    return {
        "initial_accuracy": summary["initial_accuracy"], "final_accuracy": summary["final_accuracy"],
        "best_accuracy": max(accs) if accs else None, "collapse_step": collapse_point(steps, accs),
        "late_accuracy": statistics.fmean(accs[-LATE_EVALS:]) if accs else None,
        "late_reward": statistics.fmean(rewards[-LATE_REWARD_STEPS:]) if rewards else None,
        "warning_steps": warnings, "first_warning_step": warnings[0] if warnings else None,
        "mean_ess_ratio": statistics.fmean(ess) if ess else None, "wall_time_s": summary["wall_time_s"],
        "learner_step_s": statistics.median(learner_s) if learner_s else None,
        "steps": summary["steps"],
    }


def load_cells(sweep_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(finished cells with their records and summaries, names of unfinished or failed cells)."""
    done, unfinished = [], []
    for run_dir in sorted((sweep_dir / "cells").glob("*")):
        match = CELL_NAME.match(run_dir.name)
        if not match or not run_dir.is_dir():
            continue
        if not (run_dir / "summary.json").is_file():
            unfinished.append(run_dir.name)
            continue
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        cell = {"name": run_dir.name, "arm": match["arm"], "k": config["async"]["max_staleness"],
                "seed": config["seed"], "records": read_metrics(run_dir / "metrics.jsonl")}
        done.append(cell | summarize_cell(run_dir))
    return done, unfinished


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _by_arm_k(cells: list[dict[str, Any]], key: str = "late_accuracy") -> dict[str, dict[int, float]]:
    """Mean of a cell value over seeds, per arm and k."""
    groups: dict[str, dict[int, list[float]]] = {}
    for c in cells:
        if c.get(key) is not None:
            groups.setdefault(c["arm"], {}).setdefault(c["k"], []).append(c[key])
    return {arm: {k: statistics.fmean(v) for k, v in sorted(by_k.items())} for arm, by_k in groups.items()}


def claims(cells: list[dict[str, Any]], evaluation: dict[str, Any], ks: list[int]) -> list[str]:
    """The claims under test (VCPO's (a)-(c), VESPO's (d)), each stated as held / did not hold / not tested."""
    lines = []
    collapsed_at = {arm: sorted({c["k"] for c in cells if c["arm"] == arm and c["collapse_step"] is not None})
                    for arm in BASELINES if any(c["arm"] == arm for c in cells)}
    if not collapsed_at:
        lines.append("(a) Plain and clipped objectives collapse as k grows: NOT TESTED (no baseline arm in this grid).")
    else:
        per_arm = "; ".join(f"{arm}: {', '.join(f'k={k}' for k in ks_) if ks_ else 'never'}"
                            for arm, ks_ in collapsed_at.items())
        rising = [arm for arm, ks_ in collapsed_at.items() if ks_ and 0 not in ks_]
        verdict = ("HELD" if len(rising) == len(collapsed_at) else
                   "HELD PARTLY" if rising else "DID NOT HOLD")
        lines.append(f"(a) Plain and clipped objectives collapse as k grows: {verdict} on this grid "
                     f"({len(rising)} of {len(collapsed_at)} baseline arms collapsed at some k > 0 and not at k = 0). "
                     f"Collapses by arm: {per_arm}.")
    n, hits = evaluation["collapsed"], evaluation["hits"]
    quiet_total = evaluation["false_alarms"] + evaluation["quiet"]
    if n == 0:
        lines.append("(b) Collapse is preceded by a sharp ESS fall and an unstable gradient norm: NOT TESTED "
                     f"(no run collapsed); the detector fired in {evaluation['false_alarms']} of {quiet_total} runs.")
    else:
        held = hits / n >= 0.8 and (quiet_total == 0 or evaluation["false_alarms"] / quiet_total <= 0.2)
        lines.append(f"(b) Collapse is preceded by a sharp ESS fall and an unstable gradient norm: "
                     f"{'HELD' if held else 'DID NOT HOLD'} on this grid (criterion: warned before >= 80% of "
                     f"collapses and in <= 20% of stable runs). Warned before {hits} of {n} collapses "
                     f"(median lead {_fmt(evaluation['median_lead_steps'], 1)} steps), missed {evaluation['misses']}, "
                     f"false alarms in {evaluation['false_alarms']} of {quiet_total} runs that never collapsed.")
    vcpo = _by_arm_k([c for c in cells if c["arm"] == "vcpo"]).get("vcpo", {})
    if 0 not in vcpo or len(vcpo) < 2:
        lines.append("(c) VCPO stays stable and matches synchronous accuracy up to k = 128: NOT TESTED "
                     "(needs vcpo runs at k = 0 and at some k > 0).")
    else:
        # "Synchronous accuracy": every arm's k = 0 runs (all on-policy, so alike up to noise), not only vcpo's.
        sync = statistics.fmean(c["late_accuracy"] for c in cells if c["k"] == 0 and c["late_accuracy"] is not None)
        stable = not any(c["collapse_step"] is not None for c in cells if c["arm"] == "vcpo")
        matched = all(acc >= sync - MATCH_TOLERANCE for k, acc in vcpo.items() if k > 0)
        held = stable and matched
        verdict = "HELD" if held and 128 in ks else f"HELD only up to k = {max(ks)}" if held else "DID NOT HOLD"
        scope = "" if 128 in ks else " The grid has no k = 128, so the claim at k = 128 is untested."
        detail = ", ".join(f"k={k}: {acc:.3f}" for k, acc in vcpo.items())
        lines.append(f"(c) VCPO stays stable and matches synchronous accuracy up to k = 128: "
                     f"{verdict} on this grid ({'no' if stable else 'some'} vcpo run collapsed; synchronous "
                     f"accuracy {sync:.3f} (late accuracy of every arm's k = 0 runs), tolerance {MATCH_TOLERANCE}; "
                     f"vcpo's late accuracy {detail}).{scope}")
    vespo = [c for c in cells if c["arm"] == "vespo"]
    tested = sorted({c["k"] for c in vespo if 0 < c["k"] <= 64})
    if not tested:
        lines.append("(d) VESPO stays stable up to 64x staleness: NOT TESTED (no vespo run with 0 < k <= 64).")
    else:
        collapsed = sorted({c["k"] for c in vespo if c["k"] <= 64 and c["collapse_step"] is not None})
        finals = _by_arm_k(vespo).get("vespo", {})
        detail = ", ".join(f"k={k}: {acc:.3f}" for k, acc in finals.items())
        verdict = "DID NOT HOLD" if collapsed else "HELD" if 64 in tested else f"HELD up to k = {max(tested)}"
        lines.append(f"(d) VESPO stays stable up to 64x staleness: {verdict} on this grid (collapsed at "
                     f"{', '.join(f'k={k}' for k in collapsed) if collapsed else 'no k <= 64'}; "
                     f"late accuracy {detail}).")
    return lines


def _curves(cells: list[dict[str, Any]], key: str, title: str, path: Path, log_y: bool = False,
            smooth: int = 1) -> Path:
    """Small multiples, one panel per k, one line per cell (colour per arm), collapse points marked with x."""
    ks = sorted({c["k"] for c in cells})
    arms = sorted({c["arm"] for c in cells})
    colours = {arm: f"C{i % 10}" for i, arm in enumerate(arms)}
    fig = Figure(figsize=(4.5 * len(ks), 3.6))
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.14, top=0.85, wspace=0.25)
    for i, k in enumerate(ks):
        ax = fig.add_subplot(1, len(ks), i + 1)
        for c in (c for c in cells if c["k"] == k):
            points = [(r["step"], r[key]) for r in c["records"] if isinstance(r.get(key), int | float)]
            if not points:
                continue
            steps, raw = zip(*points, strict=True)
            # A trailing moving average: per-step reward of 128 samples is too noisy to read by eye.
            values = [statistics.fmean(raw[max(0, j - smooth + 1): j + 1]) for j in range(len(raw))]
            ax.plot(steps, values, color=colours[c["arm"]], lw=1, label=c["arm"] if c["seed"] == min(
                x["seed"] for x in cells if x["arm"] == c["arm"]) else None)
            if c["collapse_step"] is not None:
                j = min(range(len(steps)), key=lambda j: abs(steps[j] - c["collapse_step"]))
                ax.plot([steps[j]], [values[j]], "x", color="black", markersize=9, mew=2)
        if log_y:
            ax.set_yscale("log")
        ax.set_title(f"k = {k}", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize=7)
    fig.suptitle(f"{title} (x = collapse)")
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=90)
    return path


def _accuracy_vs_k(cells: list[dict[str, Any]], path: Path) -> Path:
    ks = sorted({c["k"] for c in cells})
    fig = Figure(figsize=(7, 4.5))
    fig.subplots_adjust(left=0.13, right=0.75, bottom=0.12, top=0.9)
    ax = fig.add_subplot()
    for arm, by_k in _by_arm_k(cells).items():
        # k spans 0..128: evenly spaced positions keep k = 0 and k = 4 apart.
        ax.plot([ks.index(k) for k in by_k], list(by_k.values()), marker="o", label=arm)
    ax.axhline(statistics.fmean(c["initial_accuracy"] for c in cells), color="grey", ls="--", label="before RL")
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_xlabel("staleness k (steps)")
    ax.set_ylabel(f"late accuracy (last {LATE_EVALS} evals, mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=90)
    return path


def _held_out_warnings(cells: list[dict[str, Any]]) -> list[str]:
    """The detector's record on the seeds it was not designed on (it was revised after the first seed's cells)."""
    seeds = sorted({c["seed"] for c in cells})
    if len(seeds) < 2:
        return []
    e = evaluate_warnings([c for c in cells if c["seed"] != seeds[0]])
    return ["", f"On seed{'s' if len(seeds) > 2 else ''} {', '.join(map(str, seeds[1:]))} alone (the detector "
            f"was revised after inspecting seed-{seeds[0]} cells, so these are its held-out runs): cells "
            f"{e['cells']}, collapsed {e['collapsed']}, warned before collapse {e['hits']}, missed {e['misses']}, "
            f"false alarms {e['false_alarms']}, quiet and stable {e['quiet']}; lead times (steps): "
            f"{e['lead_steps'] or 'none'}."]


def write_report(sweep_dir: str | Path) -> Path:
    """Write ``sweep_dir/REPORT.md`` and its figures (accuracy vs k; accuracy, reward, ESS and grad-norm curves)."""
    sweep_dir = Path(sweep_dir)
    if not (sweep_dir / "cells").is_dir():
        raise ReportError(f"{str(sweep_dir)!r} is not a sweep directory (no cells/ inside)")
    cells, unfinished = load_cells(sweep_dir)
    if not cells:
        raise ReportError(f"no finished cell in {sweep_dir / 'cells'} (no summary.json)")
    meta_path = sweep_dir / "sweep.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    ks = sorted({c["k"] for c in cells})
    evaluation = evaluate_warnings(cells)
    detector = EarlyWarning()
    out = [f"# Sweep report: {sweep_dir.resolve().name}", "",
           f"Command: `{meta.get('command') or 'unknown'}`  ", f"Date: {meta.get('date', 'unknown')}; machine: "
           f"{meta.get('machine', 'unknown')} ({meta.get('cpu_count', '?')} CPUs); grid: "
           f"`{json.dumps(meta.get('grid', {}))}`", "",
           f"Collapse: held-out accuracy below {COLLAPSE_FRACTION} x its best so far (the pre-RL evaluation "
           "included) at an evaluation and at every later one (no recovery).  ",
           f"Early warning: the ESS ratio's {detector.smooth}-step mean < {detector.ess_drop} x its median over the "
           f"{detector.window} steps before (or < {detector.ess_floor}), or grad norm > {detector.grad_spike} x its "
           f"median over the previous {detector.window} steps (or non-finite).", "",
           "## Cells", "",
           "| arm | k | seed | initial acc | final acc | best acc | collapsed | collapse step | first warning "
           "| mean ESS ratio | wall time (s) |", "|---" * 11 + "|"]
    for c in sorted(cells, key=lambda c: (c["arm"], c["k"], c["seed"])):
        out.append(f"| {c['arm']} | {c['k']} | {c['seed']} | {_fmt(c['initial_accuracy'])} | "
                   f"{_fmt(c['final_accuracy'])} | {_fmt(c['best_accuracy'])} | "
                   f"{'yes' if c['collapse_step'] is not None else 'no'} | {_fmt(c['collapse_step'])} | "
                   f"{_fmt(c['first_warning_step'])} | {_fmt(c['mean_ess_ratio'])} | {c['wall_time_s']:.0f} |")
    if unfinished:
        out += ["", f"Unfinished or failed cells (not in any number below): {', '.join(unfinished)}."]
    for key, title in (
        ("final_accuracy", "Final held-out accuracy (last evaluation), mean over seeds"),
        ("late_accuracy", f"Late held-out accuracy (mean of the last {LATE_EVALS} evaluations), mean over seeds"),
        ("late_reward", f"Training reward (mean of the last {LATE_REWARD_STEPS} steps), mean over seeds"),
        ("mean_ess_ratio", "ESS ratio (mean over the run), mean over seeds"),
        ("learner_step_s", "Learner step time (s, median over the run's steps), mean over seeds"),
    ):
        table = _by_arm_k(cells, key)
        if not table:  # e.g. step times not recorded or not exported
            continue
        out += ["", f"## {title}", ""]
        if key == "learner_step_s":
            out += ["Wall clock of one `Learner.step` (forward, backward, per-row norms where the method needs "
                    "them, optimizer) on the cells' real batches, with as many cells at a time as the command's "
                    "`--workers` (all arms alike).", ""]
        out += ["| arm | " + " | ".join(f"k={k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
        out += [f"| {arm} | " + " | ".join(_fmt(by_k.get(k)) for k in ks) + " |" for arm, by_k in table.items()]
    out += ["", "## Early warning", "",
            f"Cells {evaluation['cells']}, collapsed {evaluation['collapsed']}, warned before collapse "
            f"{evaluation['hits']}, missed {evaluation['misses']}, false alarms {evaluation['false_alarms']}, "
            f"quiet and stable {evaluation['quiet']}; lead times (steps): {evaluation['lead_steps'] or 'none'}.",
            *_held_out_warnings(cells), "", "## Claims", "",
            *[f"- {line}" for line in claims(cells, evaluation, ks)], "", "## Figures", ""]
    figures = [
        _accuracy_vs_k(cells, sweep_dir / "accuracy_vs_k.png"),
        _curves(cells, "eval/accuracy", "Held-out accuracy", sweep_dir / "accuracy_curves.png"),
        _curves(cells, "reward/mean", "Training reward (10-step mean)", sweep_dir / "reward_curves.png", smooth=10),
        _curves(cells, "ess/ratio", "ESS ratio (10-step mean)", sweep_dir / "ess_curves.png", smooth=10),
        _curves(cells, "grad_norm", "Gradient norm (before clipping)", sweep_dir / "grad_norm_curves.png", log_y=True),
    ]
    out += [f"![{p.stem}]({p.name})" for p in figures]
    path = sweep_dir / REPORT_FILE
    path.write_text("\n".join(out) + "\n")
    return path
