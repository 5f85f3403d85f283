"""What an admission rule did to the trained distribution: a run's generated, trained and dropped groups' mean length
and pass rate (from the per-step ``groups/*`` metrics, vcpo.orchestration.tally), and trained minus generated with a
95% interval over steps. Pure functions of the metric records."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vcpo.metrics import METRICS_FILE, read_metrics
from vcpo.study.stats import Interval, t_interval

KINDS = ("generated", "trained", "dropped")
FIGURES = (("length_mean", "mean length (tokens)"), ("pass_rate", "pass rate"))


@dataclass(frozen=True)
class BiasFigure:
    """One figure (``length_mean`` or ``pass_rate``) of a run: each kind's level over the run, pooled over its groups
    (sum over steps of count x step mean, over the total count; None when the run had no group of that kind), and the
    per-step differences trained minus generated (``differences``) with their t interval over the steps that trained
    something."""

    figure: str
    level: dict[str, float | None]
    differences: list[float]
    difference: Interval | None


def _number(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def group_counts(records: list[dict[str, Any]]) -> dict[str, int]:
    """Each kind's groups over the run (sum of ``groups/{kind}_count``)."""
    return {kind: int(sum(_number(r, f"groups/{kind}_count") or 0.0 for r in records)) for kind in KINDS}


def bias_figures(records: list[dict[str, Any]]) -> list[BiasFigure]:
    """Length and pass-rate figures of a run's metric records (empty when the run logged no ``groups/*``).

    Level of kind c: sum_t n_c,t x m_c,t / sum_t n_c,t (every group weighs one prompt). Difference: d_t = m_trained,t -
    m_generated,t at each step t with both, and mean +- t(n-1) s / sqrt(n) over those steps; it treats the steps as
    independent draws (consecutive steps share groups in flight, so read it as a screen, and compare seeds)."""
    if not any(_number(r, "groups/generated_count") for r in records):
        return []
    out = []
    for figure, _ in FIGURES:
        level: dict[str, float | None] = {}
        for kind in KINDS:
            pairs = [(_number(r, f"groups/{kind}_count"), _number(r, f"groups/{kind}_{figure}")) for r in records]
            pairs = [(n, m) for n, m in pairs if n and m is not None]
            total = sum(n for n, _ in pairs)
            level[kind] = sum(n * m for n, m in pairs) / total if total else None
        steps = [(_number(r, f"groups/trained_{figure}"), _number(r, f"groups/generated_{figure}")) for r in records]
        differences = [t - g for t, g in steps if t is not None and g is not None]
        out.append(BiasFigure(figure, level, differences, t_interval(differences) if differences else None))
    return out


def bias_lines(records: list[dict[str, Any]]) -> list[str]:
    """A small Markdown table of :func:`bias_figures`, with the group counts; one line when there is nothing."""
    figures = bias_figures(records)
    if not figures:
        return ["No groups/* metrics in this run (it predates them): no bias figures."]
    counts = group_counts(records)
    names = dict(FIGURES)
    out = [f"Groups: {counts['generated']} generated, {counts['trained']} trained, {counts['dropped']} dropped "
           f"({counts['dropped'] / counts['generated']:.1%}). Levels pooled over the run's groups; "
           "trained - generated: mean of the per-step differences [95% t interval over steps] (* : the interval "
           "excludes 0).", "",
           "| figure | generated | trained | dropped | trained - generated |", "|---|---|---|---|---|"]
    for f in figures:
        cells = [f"{f.level[kind]:.3f}" if f.level[kind] is not None else "-" for kind in KINDS]
        diff = "-" if f.difference is None else f"{f.difference}{' *' if f.difference.excludes_zero() else ''}"
        out.append(f"| {names[f.figure]} | {' | '.join(cells)} | {diff} |")
    return out


def run_report(run_dir: Path) -> str:
    """``vcpo report RUN_DIR``: the run's bias table as Markdown, read only from its metrics.jsonl."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(run_dir)!r} is neither a sweep directory (no cells/ inside) nor a run "
                                f"directory (no {METRICS_FILE})")
    records = read_metrics(path)
    return "\n".join([f"# What run {Path(run_dir).resolve().name} trained on, against what it generated", "",
                      *bias_lines(records)]) + "\n"


def sweep_bias_lines(cells: list[dict[str, Any]]) -> list[str]:
    """Per arm and k: each run's mean per-step trained - generated length and pass rate, mean [95% t interval] over
    the runs; no line when no cell logged ``groups/*``."""
    rows: dict[tuple[str, int], dict[str, list[float]]] = {}
    for cell in cells:
        for f in bias_figures(cell["records"]):
            if f.difference is not None:
                rows.setdefault((cell["arm"], cell["k"]), {}).setdefault(f.figure, []).append(f.difference.mean)
    if not rows:
        return []
    out = ["| arm | k | trained - generated length (tokens) | trained - generated pass rate |", "|---|---|---|---|"]
    for (arm, k), by_figure in sorted(rows.items()):
        cells_ = [by_figure.get(figure) for figure, _ in FIGURES]
        out.append(f"| {arm} | {k} | " + " | ".join(str(t_interval(v)) if v else "-" for v in cells_) + " |")
    return out
