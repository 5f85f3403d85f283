"""Figures of a run, drawn from ``run_dir/metrics.jsonl`` alone (STYLE.md §7): one PNG per panel plus an overview.

Each panel labels its axes with units; noisy per-step series are drawn faint with an exponential moving average on
top; lines that often coincide (staleness min/mean/max, raw/clipped ESS) differ in width and dash so each stays
visible; held-out accuracy carries its 95% binomial band. Uses matplotlib's Agg canvas directly (no pyplot), so
plotting never touches a global backend or opens a window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from vcpo.errors import UserError
from vcpo.metrics import METRICS_FILE, MetricsError, read_metrics


class PlotError(UserError):
    """Nothing to plot (missing, empty or unreadable metrics file); the message is one line naming it."""


@dataclass(frozen=True)
class Line:
    """One metric key drawn in a panel. ``smooth``: the raw values faint, their moving average on top. Width and
    dash tell apart lines that often lie on top of each other (the widest is drawn first)."""

    key: str
    label: str
    color: str
    width: float = 1.6
    dash: str = "-"
    smooth: bool = True
    steps: bool = False  # integer-valued per step (staleness): drawn as a staircase, never averaged


@dataclass(frozen=True)
class Panel:
    """One figure: its lines against ``step``, a y-axis label with units, and how the axis is scaled."""

    filename: str
    title: str
    ylabel: str
    lines: tuple[Line, ...]
    log_y: bool = False
    unit_interval: bool = False  # a fraction: the y-axis spans [0, 1]
    integer_y: bool = False


EVAL_KEY = "eval/accuracy"
PANELS = (
    Panel("reward.png", "Training reward", "mean reward per completion",
          (Line("reward/mean", "reward/mean", "C0"),)),
    Panel("eval_accuracy.png", "Held-out accuracy (greedy)", "accuracy (fraction correct)",
          (Line(EVAL_KEY, "eval/accuracy", "C1", smooth=False),), unit_interval=True),
    Panel("ess_ratio.png", "Effective sample size", "ESS / batch size",
          (Line("ess/ratio", "raw weights", "C0", width=3.0),
           Line("ess/ratio_clipped", "clipped weights", "C3", width=1.4, dash="--")), unit_interval=True),
    # Collapse shows as a grad-norm spike of orders of magnitude: a log axis keeps the rest readable.
    Panel("grad_norm.png", "Gradient norm (before clipping)", "L2 norm",
          (Line("grad_norm", "grad_norm", "C2"),), log_y=True),
    Panel("staleness.png", "Staleness of the trained tokens", "policy lag (optimizer steps)",
          (Line("staleness/max", "max", "C3", width=4.0, steps=True, smooth=False),
           Line("staleness/bound", "bound in force", "0.3", width=1.2, dash=":", steps=True, smooth=False),
           Line("staleness/mean", "mean", "C0", width=1.8, smooth=False),
           Line("staleness/min", "min", "C2", width=1.2, dash="--", steps=True, smooth=False)), integer_y=True),
    Panel("lr.png", "Learning-rate scale (ESS rule)", "lr / trainer.lr",
          (Line("lr_scale", "lr_scale", "C4"),)),
)
LR_FALLBACK = Panel("lr.png", "Learning rate", "learning rate", (Line("lr", "lr", "C4"),))
Z_95 = 1.96  # two-sided 95% normal quantile


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the lines that have a finite number under ``key`` (null/NaN entries are gaps)."""
    steps, values = [], []
    initial = records[0].get("eval/accuracy_initial") if records and key == EVAL_KEY else None
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


def smoothing_span(n: int) -> int:
    """Steps averaged by the moving average of an n-point series: none below 30 points (each point is drawn),
    else about n / 12, between 3 and 25."""
    return 1 if n < 30 else max(3, min(25, n // 12))


def ema(values: list[float], span: int, log: bool = False) -> list[float]:
    """Exponential moving average with weight ``a = 2 / (span + 1)``, bias-corrected at the start (the first
    points average what came before rather than decaying from 0); ``log``: averaged in log space (positive data)."""
    a = 2.0 / (span + 1)
    total = weight = 0.0
    out = []
    for v in values:
        x = math.log(v) if log else v
        total = (1 - a) * total + a * x
        weight = (1 - a) * weight + a
        out.append(math.exp(total / weight) if log else total / weight)
    return out


def binomial_band(p: float, n: int) -> tuple[float, float]:
    """The 95% normal-approximation interval ``p +- 1.96 sqrt(p (1 - p) / n)`` of an accuracy on n problems,
    cut to [0, 1]."""
    half = Z_95 * math.sqrt(max(p * (1 - p), 0.0) / n)
    return max(0.0, p - half), min(1.0, p + half)


def eval_problems(records: list[dict[str, Any]], run_dir: Path) -> int | None:
    """Problems per held-out evaluation: the ``eval/problems`` metric, else the run's ``task.eval_size``."""
    for record in reversed(records):
        n = record.get("eval/problems")
        if isinstance(n, int | float) and n > 0:
            return int(n)
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        n = saved["task"]["eval_size"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    return n if isinstance(n, int) and n > 0 else None


def _draw(ax: Axes, panel: Panel, data: dict[Line, tuple[list[int], list[float]]], n_eval: int | None) -> None:
    log = panel.log_y and all(v > 0 for _, values in data.values() for v in values)
    for line, (steps, values) in data.items():
        span = smoothing_span(len(values)) if line.smooth else 1
        marker = "o" if len(steps) <= 30 and not line.steps else None  # few points: each stays visible
        if line.key == EVAL_KEY and n_eval:
            low, high = zip(*(binomial_band(v, n_eval) for v in values), strict=True)
            ax.fill_between(steps, low, high, color=line.color, alpha=0.2, linewidth=0,
                            label=f"95% binomial band (n = {n_eval})")
        if span > 1:
            ax.plot(steps, values, color=line.color, alpha=0.25, linewidth=0.8, label=f"{line.label}, per step")
            ax.plot(steps, ema(values, span, log=log), color=line.color, linewidth=line.width, linestyle=line.dash,
                    label=f"{line.label}, moving average ({span} steps)")
        else:
            ax.plot(steps, values, color=line.color, linewidth=line.width, linestyle=line.dash, label=line.label,
                    marker=marker, markersize=4, drawstyle="steps-post" if line.steps else "default",
                    alpha=0.55 if line.width >= 3 else 1.0)
    if log:
        ax.set_yscale("log")
    elif not panel.unit_interval:  # learning rates like 1e-6 would otherwise get labels too wide for the margin
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
    if panel.unit_interval:
        ax.set_ylim(-0.02, 1.02)
    if panel.integer_y:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(panel.ylabel + (" (log scale)" if log else ""))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if len(ax.get_legend_handles_labels()[0]) > 1:
        ax.legend(fontsize=7, loc="best", framealpha=0.8)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def plot_run(run_dir: Path) -> list[Path]:
    """Write ``run_dir/plots/*.png`` for each panel whose keys appear in the metrics, then ``overview.png``.

    Panels: reward/mean; eval/accuracy (band from ``eval/problems`` or config.yaml's task.eval_size); ess/ratio
    (+ ess/ratio_clipped); grad_norm; staleness max/bound/mean/min; lr_scale (or lr when no lr_scale was logged).
    Returns the written paths, overview last.
    """
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
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
        data = {line: _series(records, line.key) for line in panel.lines}
        data = {line: series for line, series in data.items() if series[0]}
        if data:
            drawable.append((panel, data))
    if not drawable:
        wanted = ", ".join(line.key for p in (*PANELS, LR_FALLBACK) for line in p.lines)
        raise PlotError(f"no metrics to plot: {path} has none of {wanted}")
    n_eval = eval_problems(records, run_dir)

    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for panel, data in drawable:
        fig = Figure(figsize=(6, 4))
        # Fixed margins instead of constrained layout: that layout pass doubles the time per figure.
        fig.subplots_adjust(left=0.13, right=0.97, bottom=0.12, top=0.9)
        _draw(fig.add_subplot(), panel, data, n_eval)
        written.append(_save(fig, out_dir / panel.filename))

    n_cols = min(3, len(drawable))
    n_rows = math.ceil(len(drawable) / n_cols)
    overview = Figure(figsize=(5.5 * n_cols, 4 * n_rows))
    overview.subplots_adjust(left=0.06, right=0.98, bottom=0.08, top=0.9, wspace=0.3, hspace=0.45)
    for i, (panel, data) in enumerate(drawable, start=1):
        _draw(overview.add_subplot(n_rows, n_cols, i), panel, data, n_eval)
    overview.suptitle(run_dir.resolve().name)
    written.append(_save(overview, out_dir / "overview.png"))
    return written
