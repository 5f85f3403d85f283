"""Which arm to use under staleness, read from committed cells: every arm of every setting at its own best learning
rate (issue 46; `benchmarks/staleness/what_to_use.py` prints the table of RESULTS.md "What should I use under
staleness?").

A spec (JSON) names, per setting, the sweep directories at each learning rate (``DIR``, or ``DIR::GLOB`` for some of
its cells) and the setting's reference rate. For each arm the rate is picked on k = 0 alone, as a user without stale
runs would pick it: each tried rate's paired difference in late held-out accuracy from the reference rate, over the
runs (warm start x seed) both have; the largest positive mean wins, the reference when none is positive; a rate
compared on fewer than :data:`MIN_PROBE_RUNS` runs is shown but never picked. The arm's row then reads its cells at
that rate. Per (setting, k) the best arm is the highest mean over the runs every arm there has (each arm's own runs
when they share none), so that no arm is best by having more or easier runs; every other arm is compared with it by
the paired difference over their common runs (95% Student-t interval), "within noise" when the interval holds 0
("unknown" on fewer than two common runs). An arm holds everywhere when at every (setting, k) where it ran it is
the best or within noise of it; where it is unknown is listed beside, and so is the largest loss to the best that its
"within noise" intervals still allow (their lowest bound): "within noise" on few or noisy runs is weak evidence, and
that bound says how weak. Nothing is tuned, only read.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

from vcpo.study.report import load_cells
from vcpo.study.stats import Interval, paired_difference, t_interval

Run = tuple[str | None, int]
"""One run of a cell: (warm start id, seed); cells of one setting with the same run share problems and held-out set."""
MIN_PROBE_RUNS = 2
"""A rate compared with the reference on fewer runs than this is reported but not picked."""


@dataclass
class Setting:
    """One setting's late accuracies: ``late[rate][(arm, k)][run]``."""

    name: str
    reference_rate: str
    late: dict[str, dict[tuple[str, int], dict[Run, float]]] = field(default_factory=dict)

    def runs(self, rate: str | None, arm: str, k: int) -> dict[Run, float]:
        return self.late.get(rate, {}).get((arm, k), {}) if rate is not None else {}

    def pick_rate(self, arm: str) -> tuple[str | None, dict[str, Interval]]:
        """The rate picked on k = 0 (None when the arm has no k = 0 cell) and each other tried rate's paired
        difference from the reference rate."""
        rates = [rate for rate in self.late if self.runs(rate, arm, 0)]
        if self.reference_rate not in rates:
            return (rates[0] if len(rates) == 1 else None), {}
        reference = self.runs(self.reference_rate, arm, 0)
        diffs = {rate: paired_difference(self.runs(rate, arm, 0), reference) for rate in rates
                 if rate != self.reference_rate}
        diffs = {rate: d for rate, d in diffs.items() if d is not None}
        pickable = [rate for rate, d in diffs.items() if d.n >= MIN_PROBE_RUNS and d.mean > 0]
        return max(pickable, key=lambda rate: diffs[rate].mean, default=self.reference_rate), diffs


@dataclass(frozen=True)
class Comparison:
    """One (setting, k): the best arm and every other arm's paired difference to it (None: no run in common)."""

    k: int
    best: str
    to_best: dict[str, Interval | None]

    def verdict(self, arm: str) -> str:
        """``best``, ``within`` (the paired interval holds 0), ``below`` or ``unknown`` (fewer than two common runs)."""
        if arm == self.best:
            return "best"
        d = self.to_best.get(arm)
        if d is None or d.n < 2:
            return "unknown"
        return "below" if d.excludes_zero() else "within"


def read_cells(sweep_dir: Path, pattern: str = "*") -> dict[tuple[str, int], dict[Run, float]]:
    """``(arm, k) -> run -> late accuracy`` of the finished cells of a sweep directory whose names match ``pattern``
    (read by :func:`vcpo.study.report.load_cells`)."""
    if not (sweep_dir / "cells").is_dir():
        raise FileNotFoundError(f"{sweep_dir}: no such cell directory ({sweep_dir}/cells)")
    out: dict[tuple[str, int], dict[Run, float]] = {}
    for cell in load_cells(sweep_dir)[0]:
        if fnmatch(cell["name"], pattern) and cell["late_accuracy"] is not None:
            out.setdefault((cell["arm"], cell["k"]), {})[(cell["warm_start"], cell["seed"])] = cell["late_accuracy"]
    return out


def load_settings(spec: dict, root: Path) -> list[Setting]:
    """The spec's settings, their directories relative to ``root``."""
    settings = []
    for name, entry in spec["settings"].items():
        setting = Setting(name, entry["reference_rate"])
        for rate, dirs in entry["rates"].items():
            for where in dirs:
                directory, _, pattern = where.partition("::")
                for key, runs in read_cells(root / directory, pattern or "*").items():
                    setting.late.setdefault(rate, {}).setdefault(key, {}).update(runs)
        settings.append(setting)
    return settings


def compare(setting: Setting, arms: list[str], k: int) -> Comparison | None:
    """The best arm at k (each at its picked rate, ranked over the runs all of them have) and the others' paired
    differences to it; None if none ran."""
    at = {arm: setting.runs(setting.pick_rate(arm)[0], arm, k) for arm in arms}
    at = {arm: runs for arm, runs in at.items() if runs}
    if not at:
        return None
    common = set.intersection(*(set(runs) for runs in at.values()))
    best = max(at, key=lambda arm: statistics.fmean(at[arm][run] for run in common) if common
               else statistics.fmean(at[arm].values()))
    return Comparison(k, best, {arm: paired_difference(runs, at[best]) for arm, runs in at.items() if arm != best})


def _fmt(i: Interval | None, signed: bool = False) -> str:
    if i is None:
        return "-"
    sign = "+" if signed else ""
    if i.n == 1:
        return f"{i.mean:{sign}.3f} (1)"
    return f"{i.mean:{sign}.3f} [{i.low:{sign}.3f}, {i.high:{sign}.3f}] ({i.n})"


def render(settings: list[Setting], arms: list[str], ks: list[int]) -> str:
    """The markdown: per setting a table (arm, picked rate with the probe, late accuracy at each k), the best arm per
    k with the others' paired differences, then which arms hold everywhere."""
    lines: list[str] = []
    gaps: dict[str, list[str]] = {name: [] for arm in arms for name in (arm, f"{arm}?")}
    ran: dict[str, bool] = {arm: False for arm in arms}
    worst: dict[str, tuple[float, str]] = {}  # arm -> (lowest bound of a "within" interval, where)
    for setting in settings:
        header = "| arm | rate (k = 0 probe: each rate minus the reference) | " + " | ".join(f"k = {k}" for k in ks)
        lines += [f"### {setting.name}", "", header + " |", "|---|---|" + "---|" * len(ks)]
        for arm in arms:
            rate, diffs = setting.pick_rate(arm)
            if rate is None:
                continue
            probe = "; ".join(f"{r}: {_fmt(d, signed=True)}" for r, d in diffs.items()) or "one rate tried"
            cols = [_fmt(t_interval(list(runs.values()))) if (runs := setting.runs(rate, arm, k)) else "not run"
                    for k in ks]
            lines.append(f"| {arm} | **{rate}** ({probe}) | " + " | ".join(cols) + " |")
        lines.append("")
        for k in ks:
            comparison = compare(setting, arms, k)
            if comparison is None:
                continue
            parts = []
            for arm, d in comparison.to_best.items():
                verdict = comparison.verdict(arm)
                parts.append(f"{arm} {_fmt(d, signed=True)}{'' if verdict == 'within' else f' ({verdict})'}")
                if verdict in ("below", "unknown"):
                    gaps[arm if verdict == "below" else f"{arm}?"].append(f"{setting.name} k = {k}")
                elif d.low < worst.get(arm, (0.0, ""))[0]:
                    worst[arm] = (d.low, f"{setting.name} k = {k}")
            for arm in [comparison.best, *comparison.to_best]:
                ran[arm] = True
            others = "; the others minus it: " + "; ".join(parts) if parts else " (the only arm run at its rate)"
            lines.append(f"- k = {k}: best **{comparison.best}**{others}")
        lines.append("")
    lines += ["### Best or within noise of the best at every setting and k where it ran", ""]
    for arm in (arm for arm in arms if ran[arm]):
        verdict = "yes" if not gaps[arm] else "no, below at " + ", ".join(gaps[arm])
        unknown = f" (too few runs to tell at {', '.join(gaps[arm + '?'])})" if gaps[arm + "?"] else ""
        allows = (f"; within noise allows a loss of up to {-worst[arm][0]:.3f} ({worst[arm][1]})"
                  if not gaps[arm] and arm in worst else "")
        lines.append(f"- {arm}: {verdict}{unknown}{allows}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", type=Path, help="the JSON spec; its directories are relative to the spec's own")
    args = ap.parse_args(argv)
    try:
        spec = json.loads(args.spec.read_text())
        settings = load_settings(spec, args.spec.parent)
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"error: {args.spec}: {exc}") from None
    print(render(settings, spec["arms"], spec["ks"]), end="")
