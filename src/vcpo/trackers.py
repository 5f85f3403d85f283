"""The experiment trackers of ``logging.report_to``: sinks of the one metrics path (``vcpo.metrics.MetricsLogger``)
that receive each metrics.jsonl dict once written. Each tracker is an optional extra of its own name, imported only
by a run that reports to it; ``check_trackers`` names a missing one before any heavy import."""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from vcpo.errors import UserError

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
"""Each tracker and the module its extra installs."""


class TrackerError(UserError):
    """A tracker that cannot be used; the message is one line naming it and the extra that installs it."""


class MetricsSink(Protocol):
    """Receives every metrics dict after metrics.jsonl holds it: numbers only, non-finite ones already None."""

    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def check_trackers(report_to: list[str]) -> None:
    """``TrackerError`` naming the first tracker of ``report_to`` whose package is not installed (no import)."""
    for name in report_to:
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise TrackerError(f"logging.report_to has {name!r}, which needs the {name!r} extra: "
                               f"pip install 'vcpo[{name}]'")


class TensorBoardSink:
    """Scalars under ``run_dir/tensorboard``, the dict's step as the global step."""

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in ``project`` named ``run_name``, its files under ``run_dir/wandb``; ``WANDB_MODE=offline``
    keeps it there for ``wandb sync``. The resolved config is the run's config."""

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=project, name=run_name, dir=str(run_dir), config=config)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """An MLflow run in experiment ``project`` named ``run_name``: at ``MLFLOW_TRACKING_URI`` when it is set, else
    in the SQLite store ``run_dir/mlflow.db``. The resolved config's leaves are its parameters."""

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').absolute()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.client.log_batch(self.run_id, params=[Param(key, str(value)[:6000]) for key, value in _leaves(config)])

    def write(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now_ms, step) for key, value in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioSink:
    """A trackio run in ``project`` named ``run_name``, in trackio's local store (``TRACKIO_DIR``)."""

    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict[str, Any]) -> None:
        import trackio

        self.run = trackio.init(project=project, name=run_name, config=config)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink, "trackio": TrackioSink}


@contextmanager
def open_trackers(report_to: list[str], run_dir: Path, project: str, run_name: str,
                  config: dict[str, Any]) -> Iterator[list[MetricsSink]]:
    """``with open_trackers(...) as sinks:`` one sink per tracker of ``report_to``, in order, each closed at the
    end (those already open also when a later one fails to open)."""
    check_trackers(report_to)
    sinks: list[MetricsSink] = []
    try:
        for name in report_to:
            sinks.append(SINKS[name](Path(run_dir), project, run_name, config))
        yield sinks
    finally:
        for sink in sinks:
            sink.close()


def _leaves(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a nested dict."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out
