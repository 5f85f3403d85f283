"""`vcpo report SWEEP_DIR`: REPORT.md (provenance, per-run and per-(arm, k) tables with 95% intervals, what was
trained against what was generated, collapse counts, early-warning rules tuned and held out, claims with paired
comparisons) and PNG figures, read only from the cells' metrics.jsonl, summary.json, config.yaml and cell.json (plus
sweep.json for the command).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

import yaml

from vcpo.metrics import read_metrics
from vcpo.study import detector as rules
from vcpo.study.bias import sweep_bias_lines
from vcpo.study.claims import by_run, claims, collapse_count, paired_difference
from vcpo.study.collapse import (
    COLLAPSE_FRACTION,
    EarlyWarning,
    collapse_point,
    eval_series,
    evaluate_warnings,
    warning_steps,
)
from vcpo.study.figures import accuracy_vs_k, curves
from vcpo.study.provenance import read_cell_record
from vcpo.study.stats import Interval, t_interval

REPORT_FILE = "REPORT.md"
CELL_NAME = re.compile(r"^(?P<arm>.+?)_k(?P<k>\d+)(?:_(?P<ws>[A-Za-z0-9-]+))?_s(?P<seed>\d+)$")
LATE_EVALS = 3
"""Late accuracy: the mean of a run's last LATE_EVALS held-out evaluations (one 500-problem evaluation has a
binomial standard error of about 0.022 at accuracy 0.5, 0.035 for 200 problems at 0.3)."""
LATE_REWARD_STEPS = 50
REFERENCE_ARM = "grpo"
"""The paired-comparison table gives every arm's late accuracy minus this arm's, run by run."""


class ReportError(Exception):
    """Nothing to report, or cells that must not be mixed; the message is one line naming them."""


def summarize_cell(run_dir: Path) -> dict[str, Any]:
    """A finished cell's key numbers: accuracies, collapse step, warnings, mean ESS ratio, wall time."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_metrics(run_dir / "metrics.jsonl")
    steps, accs = eval_series(records)
    ess = [r["ess/ratio"] for r in records if isinstance(r.get("ess/ratio"), int | float)]
    rewards = [r["reward/mean"] for r in records if isinstance(r.get("reward/mean"), int | float)]
    learner_s = [r["time/learner_s"] for r in records if isinstance(r.get("time/learner_s"), int | float)]
    bounds = [r["staleness/bound"] for r in records if isinstance(r.get("staleness/bound"), int | float)]
    warnings = warning_steps(records)
    late = statistics.fmean(accs[-LATE_EVALS:]) if accs else None
    return {
        "initial_accuracy": summary["initial_accuracy"], "final_accuracy": summary["final_accuracy"],
        "best_accuracy": max(accs) if accs else None, "collapse_step": collapse_point(steps, accs),
        "late_accuracy": late, "late_gain": late - summary["initial_accuracy"] if late is not None else None,
        "late_reward": statistics.fmean(rewards[-LATE_REWARD_STEPS:]) if rewards else None,
        "warning_steps": warnings, "first_warning_step": warnings[0] if warnings else None,
        "mean_ess_ratio": statistics.fmean(ess) if ess else None, "wall_time_s": summary["wall_time_s"],
        "learner_step_s": statistics.median(learner_s) if learner_s else None,
        "steps": summary["steps"],
        "mean_bound": statistics.fmean(bounds) if bounds else None,
    }


def _cell_k(async_config: dict[str, Any]) -> int:
    """A cell's staleness k: its fixed bound, or an adaptive cell's upper bound ``async.auto.k_max``."""
    k = async_config["max_staleness"]
    return int(async_config["auto"]["k_max"]) if k == "auto" else int(k)


def load_cells(sweep_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(finished cells with their records, summaries and provenance, names of unfinished or failed cells)."""
    done, unfinished = [], []
    for run_dir in sorted((sweep_dir / "cells").glob("*")):
        match = CELL_NAME.match(run_dir.name)
        if not match or not run_dir.is_dir():
            continue
        if not (run_dir / "summary.json").is_file():
            unfinished.append(run_dir.name)
            continue
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        record = read_cell_record(run_dir) or {}
        ws = record.get("warm_start") or {}
        cell = {"name": run_dir.name, "arm": match["arm"], "k": _cell_k(config["async"]),
                "seed": config["seed"], "warm_start": match["ws"] or ws.get("id"), "warm_start_hash": ws.get("hash"),
                "git": record.get("git") or {}, "records": read_metrics(run_dir / "metrics.jsonl")}
        done.append(cell | summarize_cell(run_dir))
    return done, unfinished


def check_warm_starts(cells: list[dict[str, Any]]) -> dict[str, str]:
    """Each recorded warm-start id's hash; raises ReportError when two cells of one id started from different
    models (e.g. a grid resumed after the pinned model changed), since their numbers cannot be pooled."""
    seen: dict[str, tuple[str, str]] = {}
    for cell in cells:
        ws, sha = cell["warm_start"], cell["warm_start_hash"]
        if ws is None or sha is None:
            continue
        if ws in seen and seen[ws][0] != sha:
            raise ReportError(f"cells {seen[ws][1]} and {cell['name']} both claim warm start {ws!r} but started "
                              f"from different models (hash {seen[ws][0]} vs {sha}); report them apart")
        seen.setdefault(ws, (sha, cell["name"]))
    return {ws: sha for ws, (sha, _) in sorted(seen.items())}


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def intervals(cells: list[dict[str, Any]], key: str) -> dict[str, dict[int, Interval]]:
    """Per arm and k, the t interval of a cell value over that arm's runs (warm starts x seeds)."""
    groups: dict[str, dict[int, list[float]]] = {}
    for c in cells:
        if c.get(key) is not None:
            groups.setdefault(c["arm"], {}).setdefault(c["k"], []).append(c[key])
    return {arm: {k: t_interval(v) for k, v in sorted(by_k.items())} for arm, by_k in groups.items()}


def _table(rows: dict[str, dict[int, Any]], ks: list[int]) -> list[str]:
    out = ["| arm | " + " | ".join(f"k={k}" for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]
    return out + [f"| {arm} | " + " | ".join(str(by_k[k]) if k in by_k else "-" for k in ks) + " |"
                  for arm, by_k in rows.items()]


def detector_results(cells: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The early-warning rules tuned on one split and scored on the held-out one (None without two splits)."""
    split = rules.detector_split(cells)
    if split is None:
        return None
    tune_cells, held_out, how = split
    fixed = EarlyWarning()
    rows = [{"name": "issue 5's rule (fixed)", "rule": f"ESS {fixed.smooth}-step mean < {fixed.ess_drop} x its "
             f"{fixed.window}-step median or < {fixed.ess_floor}, or grad norm > {fixed.grad_spike} x median",
             "tuning": evaluate_warnings(tune_cells), "held_out": evaluate_warnings(held_out)}]
    for name, family in (("ESS below x (trivial baseline)", rules.BASELINE_RULES),
                         ("training reward falls", rules.REWARD_RULES),
                         ("ESS low while the gradient is weak", rules.GRAD_RULES)):
        tuned = rules.tune(family, tune_cells)
        if tuned is not None:
            rule, on_tuning = tuned
            rows.append({"name": name, "rule": rule.describe(), "tuning": on_tuning,
                         "held_out": rules.score(rule, held_out)})
    for row in rows:
        h = row["held_out"]
        row["met"] = bool(h["recall"] is not None and h["recall"] >= 0.8 and (h["false_alarm_rate"] or 0.0)
                          < rules.MAX_FALSE_ALARM_RATE)
    best = max(rows[1:] or rows, key=lambda row: rules.preference(row["tuning"]))
    return {"how": how, "rows": rows, "best": best}


def _detector_lines(result: dict[str, Any] | None) -> list[str]:
    if result is None:
        return ["Not scored: the cells have a single warm start and a single seed (no held-out split)."]
    untuned = "" if len(result["rows"]) > 1 else " No run of the tuning split collapsed: nothing to tune the rules on."
    out = [f"Rules {result['how']}.{untuned} Each family's parameters are chosen on the tuning split: most "
           f"recall with false alarms in under {rules.MAX_FALSE_ALARM_RATE:.0%} of stable runs, else recall minus "
           "false-alarm rate. "
           "Recall: collapses warned at or before the collapse step; false alarms: runs that never collapsed but "
           f"warned; alarms per stable run: warnings more than {rules.EPISODE_GAP} steps apart count apart; lead: "
           "collapse step minus the first warning.", "",
           "| rule | split | collapsed | warned before | false alarms (runs) | alarms per stable run | median lead |",
           "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        for split in ("tuning", "held_out"):
            s = row[split]
            stable = s["false_alarms"] + s["quiet"]
            out.append(f"| {row['name']}: {row['rule']} | {split.replace('_', '-')} | {s['collapsed']} | "
                       f"{s['hits']} | {s['false_alarms']}/{stable} | {_fmt(s.get('alarms_per_stable_run'), 2)} | "
                       f"{_fmt(s['median_lead_steps'], 1)} |")
    return out


def _provenance_lines(cells: list[dict[str, Any]], hashes: dict[str, str]) -> list[str]:
    commits = sorted({(c["git"].get("commit") or "")[:10] + (" (dirty)" if c["git"].get("dirty") else "")
                      for c in cells if c["git"].get("commit")})
    out = [f"Code: {', '.join(commits) if commits else 'not recorded (cells predate provenance)'}.  "]
    for ws in sorted({c["warm_start"] for c in cells if c["warm_start"]}):
        initial = t_interval([c["initial_accuracy"] for c in cells if c["warm_start"] == ws])
        out.append(f"Warm start {ws}: hash {hashes.get(ws, 'not recorded')}, accuracy before RL {initial} "
                   f"(over its cells' held-out sets).  ")
    return out


def write_report(sweep_dir: str | Path) -> Path:
    """Write ``sweep_dir/REPORT.md`` and its figures (accuracy vs k; accuracy, reward, ESS and grad-norm curves)."""
    sweep_dir = Path(sweep_dir)
    if not (sweep_dir / "cells").is_dir():
        raise ReportError(f"{str(sweep_dir)!r} is not a sweep directory (no cells/ inside)")
    cells, unfinished = load_cells(sweep_dir)
    if not cells:
        raise ReportError(f"no finished cell in {sweep_dir / 'cells'} (no summary.json)")
    hashes = check_warm_starts(cells)
    meta_path = sweep_dir / "sweep.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    ks = sorted({c["k"] for c in cells})
    detector = detector_results(cells)
    out = [f"# Sweep report: {sweep_dir.resolve().name}", "",
           f"Command: `{meta.get('command') or 'unknown'}`  ", f"Date: {meta.get('date', 'unknown')}; machine: "
           f"{meta.get('machine', 'unknown')} ({meta.get('cpu_count', '?')} CPUs); grid: "
           f"`{json.dumps(meta.get('grid', {}))}`  ", *_provenance_lines(cells, hashes), "",
           f"Collapse: held-out accuracy below {COLLAPSE_FRACTION} x its best so far (the pre-RL evaluation "
           "included) at an evaluation and at every later one (no recovery). Late accuracy: the mean of a run's "
           f"last {LATE_EVALS} evaluations. Intervals: 95% Student-t over a cell's runs (warm starts x seeds); "
           "collapse counts with 95% Wilson intervals; differences between arms paired over runs of the same "
           "warm start and seed (same problem stream and held-out set), t intervals of the differences.", "",
           "## Runs", "",
           "| arm | k | warm start | seed | initial acc | late acc | final acc | best acc | collapse step "
           "| mean ESS ratio | wall time (s) |", "|---" * 11 + "|"]
    for c in sorted(cells, key=lambda c: (c["arm"], c["k"], str(c["warm_start"]), c["seed"])):
        out.append(f"| {c['arm']} | {c['k']} | {c['warm_start'] or '-'} | {c['seed']} | {_fmt(c['initial_accuracy'])} "
                   f"| {_fmt(c['late_accuracy'])} | {_fmt(c['final_accuracy'])} | {_fmt(c['best_accuracy'])} | "
                   f"{_fmt(c['collapse_step'])} | {_fmt(c['mean_ess_ratio'])} | {c['wall_time_s']:.0f} |")
    if unfinished:
        out += ["", f"Unfinished or failed cells (not in any number below): {', '.join(unfinished)}."]
    late = intervals(cells, "late_accuracy")
    for key, title, with_interval in (
        ("late_accuracy", "Late held-out accuracy, mean [95% interval] over runs", True),
        ("late_gain", "Late accuracy minus accuracy before RL, mean [95% interval] over runs", True),
        ("late_reward", f"Training reward (mean of the last {LATE_REWARD_STEPS} steps), mean over runs", False),
        ("mean_ess_ratio", "ESS ratio (mean over the run), mean over runs", False),
        ("learner_step_s", "Learner step time (s, median over the run's steps), mean over runs", False),
    ):
        table: dict[str, dict[int, Any]] = intervals(cells, key)
        if not table:  # e.g. step times not recorded or not exported
            continue
        if not with_interval:
            table = {arm: {k: _fmt(iv.mean) for k, iv in by_k.items()} for arm, by_k in table.items()}
        out += ["", f"## {title}", "", *_table(table, ks)]
    out += ["", "## Collapsed runs, count/runs (rate [95% Wilson interval])", "",
            *_table({arm: {k: collapse_count([c for c in cells if c["arm"] == arm and c["k"] == k]) for k in by_k}
                     for arm, by_k in late.items()}, ks)]
    reference = {k: by_run(cells, REFERENCE_ARM, k) for k in ks}
    paired = {arm: {k: paired_difference(by_run(cells, arm, k), reference[k]) for k in by_k}
              for arm, by_k in late.items() if arm != REFERENCE_ARM}
    out += ["", f"## Late accuracy minus {REFERENCE_ARM}'s, paired over runs (* : the interval excludes 0)", "",
            *_table({arm: {k: f"{iv}{' *' if iv.excludes_zero() else ''}" for k, iv in by_k.items() if iv}
                     for arm, by_k in paired.items()}, ks)]
    if bias := sweep_bias_lines(cells):
        out += ["", "## What was trained against what was generated (groups/*), mean [95% interval] over runs", "",
                *bias]
    out += ["", "## Early warning", "", *_detector_lines(detector), "", "## Claims", "",
            *[f"- {line}" for line in claims(cells, ks, detector)], "", "## Figures", ""]
    initial = statistics.fmean(c["initial_accuracy"] for c in cells)
    figures = [
        accuracy_vs_k(late, initial, f"late accuracy (last {LATE_EVALS} evals), mean and 95% interval",
                      sweep_dir / "accuracy_vs_k.png"),
        curves(cells, "eval/accuracy", "Held-out accuracy", sweep_dir / "accuracy_curves.png"),
        curves(cells, "reward/mean", "Training reward (10-step mean)", sweep_dir / "reward_curves.png", smooth=10),
        curves(cells, "ess/ratio", "ESS ratio (10-step mean)", sweep_dir / "ess_curves.png", smooth=10),
        curves(cells, "grad_norm", "Gradient norm (before clipping)", sweep_dir / "grad_norm_curves.png", log_y=True),
    ]
    out += [f"![{p.stem}]({p.name})" for p in figures]
    path = sweep_dir / REPORT_FILE
    path.write_text("\n".join(out) + "\n")
    return path
