"""Figures of a run, drawn from ``run_dir/metrics.jsonl`` alone (STYLE.md §7): one PNG per panel plus an overview.

Uses matplotlib's Agg canvas directly (no pyplot), so plotting never touches a global backend or opens a window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from vcpo.errors import UserError
from vcpo.metrics import METRICS_FILE, MetricsError, read_metrics


class PlotError(UserError):
    """Nothing to plot (missing, empty or unreadable metrics file); the message is one line naming it."""


@dataclass(frozen=True)
class Panel:
    """One figure: the metric keys drawn as lines against ``step``."""

    filename: str
    title: str
    keys: tuple[str, ...]
    log_y: bool = False


PANELS = (
    Panel("reward.png", "Reward (mean)", ("reward/mean",)),
    Panel("eval_accuracy.png", "Held-out accuracy", ("eval/accuracy",)),
    Panel("ess_ratio.png", "ESS ratio (ESS / B)", ("ess/ratio", "ess/ratio_clipped")),
    # Collapse shows as a grad-norm spike of orders of magnitude: a log axis keeps the rest readable.
    Panel("grad_norm.png", "Gradient norm (before clipping)", ("grad_norm",), log_y=True),
    Panel("staleness.png", "Staleness (policy lag, steps)", ("staleness/mean", "staleness/max", "staleness/min")),
    Panel("lr.png", "Learning-rate scale", ("lr_scale",)),
)
LR_FALLBACK = Panel("lr.png", "Learning rate", ("lr",))


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the lines that have a finite number under ``key`` (null/NaN entries are gaps)."""
    steps, values = [], []
    initial = records[0].get("eval/accuracy_initial") if records and key == "eval/accuracy" else None
    if isinstance(initial, int | float) and math.isfinite(initial):  # the warm start, before any RL step
        steps.append(0)
        values.append(float(initial))
    for record in records:
        step, value = record.get("step"), record.get(key)
        if isinstance(step, int) and isinstance(value, int | float) and not isinstance(value, bool):
            if math.isfinite(value):
                steps.append(step)
                values.append(float(value))
    return steps, values


def _draw(ax: Axes, panel: Panel, data: dict[str, tuple[list[int], list[float]]]) -> None:
    for key, (steps, values) in data.items():
        # Sparse series (evaluations every N steps) get markers so single points stay visible.
        ax.plot(steps, values, label=key, marker="o" if len(steps) <= 30 else None, markersize=3)
    all_values = [v for _, values in data.values() for v in values]
    if panel.log_y and min(all_values) > 0:
        ax.set_yscale("log")
    else:  # learning rates like 1e-6 would otherwise get labels too wide for the margin
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if len(data) > 1:
        ax.legend(fontsize=8)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def plot_run(run_dir: Path) -> list[Path]:
    """Write ``run_dir/plots/*.png`` for each panel whose keys appear in the metrics, then ``overview.png``.

    Panels: reward/mean; eval/accuracy; ess/ratio (+ ess/ratio_clipped); grad_norm; staleness
    mean/max/min; lr_scale (or lr when no lr_scale was logged). Returns the written paths, overview last.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise PlotError(f"no metrics to plot: {path} not found")
    try:
        records = read_metrics(path)
    except MetricsError as e:
        raise PlotError(str(e)) from None
    if not records:
        raise PlotError(f"no metrics to plot: {path} is empty")

    panels = list(PANELS)
    if not _series(records, "lr_scale")[0]:
        panels[-1] = LR_FALLBACK
    drawable = []
    for panel in panels:
        data = {key: _series(records, key) for key in panel.keys}
        data = {key: series for key, series in data.items() if series[0]}
        if data:
            drawable.append((panel, data))
    if not drawable:
        wanted = ", ".join(k for p in (*PANELS, LR_FALLBACK) for k in p.keys)
        raise PlotError(f"no metrics to plot: {path} has none of {wanted}")

    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for panel, data in drawable:
        fig = Figure(figsize=(6, 4))
        # Fixed margins instead of constrained layout: that layout pass doubles the time per figure.
        fig.subplots_adjust(left=0.13, right=0.97, bottom=0.12, top=0.9)
        _draw(fig.add_subplot(), panel, data)
        written.append(_save(fig, out_dir / panel.filename))

    n_cols = min(3, len(drawable))
    n_rows = math.ceil(len(drawable) / n_cols)
    overview = Figure(figsize=(5 * n_cols, 3.5 * n_rows))
    overview.subplots_adjust(left=0.07, right=0.98, bottom=0.1, top=0.88, wspace=0.25, hspace=0.45)
    for i, (panel, data) in enumerate(drawable, start=1):
        _draw(overview.add_subplot(n_rows, n_cols, i), panel, data)
    overview.suptitle(Path(run_dir).resolve().name)
    written.append(_save(overview, out_dir / "overview.png"))
    return written
