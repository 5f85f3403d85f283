"""The sweep report's figures: accuracy against k (mean over runs) and per-run curves, one panel per k."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from vcpo.study.stats import Interval


def curves(cells: list[dict[str, Any]], key: str, title: str, path: Path, log_y: bool = False,
            smooth: int = 1) -> Path:
    """Small multiples, one panel per k, one line per cell (colour per arm), collapse points marked with x."""
    ks = sorted({c["k"] for c in cells})
    arms = sorted({c["arm"] for c in cells})
    colours = {arm: f"C{i % 10}" for i, arm in enumerate(arms)}
    fig = Figure(figsize=(4.5 * len(ks), 3.6))
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.14, top=0.85, wspace=0.25)
    labelled: set[str] = set()
    for i, k in enumerate(ks):
        ax = fig.add_subplot(1, len(ks), i + 1)
        for c in (c for c in cells if c["k"] == k):
            points = [(r["step"], r[key]) for r in c["records"] if isinstance(r.get(key), int | float)]
            if not points:
                continue
            steps, raw = zip(*points, strict=True)
            # A trailing moving average: per-step reward of 128 samples is too noisy to read by eye.
            values = [statistics.fmean(raw[max(0, j - smooth + 1): j + 1]) for j in range(len(raw))]
            ax.plot(steps, values, color=colours[c["arm"]], lw=0.8, alpha=0.7,
                    label=None if c["arm"] in labelled else c["arm"])
            labelled.add(c["arm"])
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


def accuracy_vs_k(table: dict[str, dict[int, Interval]], initial: float, ylabel: str, path: Path) -> Path:
    """Each arm's mean over runs against k, with its 95% interval as error bars; the pre-RL accuracy dashed."""
    ks = sorted({k for by_k in table.values() for k in by_k})
    fig = Figure(figsize=(7.5, 4.5))
    fig.subplots_adjust(left=0.12, right=0.75, bottom=0.12, top=0.92)
    ax = fig.add_subplot()
    for i, (arm, by_k) in enumerate(table.items()):
        # k spans 0..128: evenly spaced positions keep k = 0 and k = 4 apart; a small shift per arm keeps
        # the error bars apart.
        x = [ks.index(k) + 0.04 * (i - len(table) / 2) for k in by_k]
        means = [iv.mean for iv in by_k.values()]
        errors = [[iv.mean - iv.low for iv in by_k.values()], [iv.high - iv.mean for iv in by_k.values()]]
        ax.errorbar(x, means, yerr=errors, marker="o", capsize=2, lw=1, label=arm)
    ax.axhline(initial, color="grey", ls="--", label="before RL")
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_xlabel("staleness k (steps)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=90)
    return path
