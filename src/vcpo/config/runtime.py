"""``runtime`` and ``logging``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from vcpo.config.base import _Strict


class RuntimeConfig(_Strict):
    """Process settings."""

    torch_threads: int = Field(1, gt=0)
    """Intra-op threads per process. One is fastest for the tiny default model on a shared 2-core
    machine (measured 3-5x faster per step than 2), and async mode runs two processes."""


class LoggingConfig(_Strict):
    """What a run reports beside metrics.jsonl (always written)."""

    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(default_factory=list)
    """Trackers that also receive every metrics.jsonl line (docs/trackers.md), each an extra of its name
    (``pip install 'vcpo[wandb]'``): ``tensorboard`` (events under {run_dir}/tensorboard), ``wandb`` (files under
    {run_dir}/wandb; ``WANDB_MODE=offline`` keeps them there for ``wandb sync``), ``mlflow`` (at
    ``MLFLOW_TRACKING_URI``, else the SQLite store {run_dir}/mlflow.db), ``trackio`` (its local store). The old key
    ``tensorboard: true`` still means ``[tensorboard]``."""
    project: str = "vcpo"
    """The W&B project, MLflow experiment and trackio project the run reports to."""
    run_name: str | None = None
    """The run's name in the trackers; None = the run directory's name."""
    progress: bool = True
    """Show a progress bar and warm-start messages on the terminal."""

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_key(cls, data: Any) -> Any:
        """``tensorboard: true`` (the key before report_to) adds tensorboard to report_to; ``false`` is dropped."""
        if isinstance(data, dict) and "tensorboard" in data:
            data = dict(data)
            if data.pop("tensorboard") is True:
                reported = list(data.get("report_to") or [])
                data["report_to"] = reported if "tensorboard" in reported else [*reported, "tensorboard"]
        return data

    @field_validator("report_to")
    @classmethod
    def _each_once(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"names a tracker twice: {v}")
        return v


