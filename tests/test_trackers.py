"""logging.report_to: TensorBoard, W&B (offline), MLflow (local SQLite store) and trackio (local store) each receive
the metrics.jsonl dicts of a real `vcpo train` run; a tracker whose extra is missing is one error before the start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vcpo.config import load_config
from vcpo.metrics import MetricsLogger, read_metrics
from vcpo.testing.faults import command_env
from vcpo.trackers import TrackerError, check_trackers

from conftest import ROOT, vcpo

TRACKED = ["reward/mean", "ess/ratio", "lr"]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, tiny):
    """A 2-step run reporting to every tracker, with W&B offline and trackio's store in the test's directory."""
    base = tmp_path_factory.mktemp("trackers")
    run_dir, trackio_dir = base / "run", base / "trackio"
    env = {**command_env(), "WANDB_MODE": "offline", "TRACKIO_DIR": str(trackio_dir), "WANDB_SILENT": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(
        [sys.executable, "-m", "vcpo.cli", "train", *tiny, f"run_dir={run_dir}", "async.mode=sync",
         "trainer.max_steps=2", "logging.report_to=[tensorboard,wandb,mlflow,trackio]", "logging.project=vcpo-test",
         "logging.run_name=tracked"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in line]
    return run_dir, trackio_dir, env, lines


def test_tensorboard_holds_every_line(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, _, lines = tracked_run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for key in TRACKED:
        assert [(e.step, pytest.approx(e.value)) for e in events.Scalars(key)] == [(r["step"], r[key]) for r in lines]


def test_wandb_offline_run_is_ready_for_wandb_sync(tracked_run):
    run_dir, _, env, lines = tracked_run
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (records,) = offline.glob("run-*.wandb")
    data = records.read_bytes()  # W&B's record log: the run's project, name, config and one history row per line
    assert b"vcpo-test" in data and b"tracked" in data and b"max_steps" in data
    assert data.count(b"reward/mean") >= len(lines)
    dry = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run", str(offline)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert dry.returncode == 0 and f"Would sync 1 run(s):\nwandb:   {records}" in dry.stdout + dry.stderr


def test_mlflow_sqlite_store_holds_every_line_and_the_config(tracked_run):
    from mlflow.tracking import MlflowClient

    run_dir, _, _, lines = tracked_run
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("vcpo-test").experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["trainer.max_steps"] == "2" and run.data.params["logging.report_to"].startswith("[")
    for key in TRACKED:
        history = client.get_metric_history(run.info.run_id, key)
        assert [(m.step, pytest.approx(m.value)) for m in history] == [(r["step"], r[key]) for r in lines]


def test_trackio_local_store_holds_every_line(tracked_run):
    _run_dir, trackio_dir, env, lines = tracked_run
    program = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage; "
               "print(json.dumps(SQLiteStorage.get_logs('vcpo-test', 'tracked'), default=str))")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    logged = [row for row in json.loads(proc.stdout) if "reward/mean" in row]
    for key in TRACKED:
        assert [(row["step"], pytest.approx(row[key])) for row in logged] == [(r["step"], r[key]) for r in lines]
    assert any(trackio_dir.iterdir())


def test_a_missing_extra_is_one_error_before_the_run_starts(tmp_path, monkeypatch, tiny):
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python marks a module as not importable
    with pytest.raises(TrackerError, match=r"'wandb' extra: pip install 'vcpo\[wandb\]'"):
        check_trackers(["tensorboard", "wandb"])
    run_dir = tmp_path / "run"
    blocked = ["-c", "import sys; sys.modules['mlflow'] = None; from vcpo.cli import main; main()"]
    proc = vcpo("train", *tiny, f"run_dir={run_dir}", "logging.report_to=[mlflow]", check=False, python=blocked)
    assert proc.returncode != 0 and "pip install 'vcpo[mlflow]'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not run_dir.exists()


def test_report_to_is_validated_and_the_old_tensorboard_key_still_works():
    assert load_config(None, ["logging.report_to=[wandb,mlflow]"]).logging.report_to == ["wandb", "mlflow"]
    assert load_config(None, ["logging.tensorboard=true"]).logging.report_to == ["tensorboard"]
    assert load_config(None, ["logging.tensorboard=false"]).logging.report_to == []
    assert "tensorboard" not in load_config(None).to_dict()["logging"]
    for bad in ("logging.report_to=[neptune]", "logging.report_to=[wandb,wandb]"):
        with pytest.raises(ValueError, match="report_to"):
            load_config(None, [bad])


def test_sinks_get_the_numbers_of_each_line(tmp_path):
    class Kept:
        def __init__(self) -> None:
            self.lines: list[tuple[int, dict]] = []

        def write(self, step: int, metrics: dict) -> None:
            self.lines.append((step, metrics))

        def close(self) -> None:
            raise AssertionError("the sinks' owner closes them")

    kept = Kept()
    with MetricsLogger(tmp_path, [kept]) as logger:
        logger.log({"step": 3, "reward/mean": 0.5, "loss": float("nan"), "skip_reason": "x", "alarm": True, "n": 2})
    assert kept.lines == [(3, {"reward/mean": 0.5, "n": 2})]
