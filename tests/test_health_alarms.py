"""Health alarms (issue 26): each rule on hand-made metric streams, the monitor's checkpointed state, and through the
real command line: the lr = 1e3 run warns within 5 steps, `trainer.on_alarm=stop` exits 3 with a checkpoint of the
last step no rule flagged, and `rollback` recovers a run whose gradient turns NaN while the learning rate is high."""

from __future__ import annotations

import json
import math

from vcpo.config import HealthConfig
from vcpo.errors import HealthAlarm
from vcpo.train.alarms import RULES, HealthMonitor

from conftest import LAGGED, metrics, vcpo


def _line(step: int, **values) -> dict:
    base = {"step": step, "reward/mean": 0.5, "ess/ratio": 0.9, "grad_norm": 1.0, "response/logprob_mean": -0.6,
            "skipped_step": 0.0}
    return base | values


def _feed(monitor: HealthMonitor, lines: list[dict]) -> list[list[str]]:
    return [[a.rule for a in monitor.observe(line)] for line in lines]


def test_healthy_steps_raise_nothing_and_log_every_rule_at_zero():
    monitor = HealthMonitor(HealthConfig())
    assert _feed(monitor, [_line(s) for s in range(1, 60)]) == [[]] * 59
    assert {monitor.metrics[f"health/alarm_{rule}"] for rule in RULES} == {0.0}
    assert monitor.metrics["health/ess_mean"] == 0.9 and monitor.metrics["health/entropy"] == 0.6


def test_a_dead_policy_fires_after_its_streak_and_suspects_the_weights_before_it():
    monitor = HealthMonitor(HealthConfig(dead_steps=3))
    dead = {"grad_norm": 0.0, "response/logprob_mean": -1e-6}
    fired = _feed(monitor, [_line(1), _line(2, **dead), _line(3, **dead), _line(4, **dead), _line(5, **dead)])
    assert fired == [[], [], [], ["dead_policy"], ["dead_policy"]]
    monitor = HealthMonitor(HealthConfig(dead_steps=3))
    _feed(monitor, [_line(1), _line(2, **dead), _line(3, **dead)])
    (alarm,) = monitor.observe(_line(4, **dead))
    assert alarm.last_good == 0 and not alarm.repeat  # step 2's line came from step 1's weights
    assert monitor.observe(_line(5, **dead))[0].repeat
    assert "sampled-token entropy 1e-06 < 0.001" in alarm.line()
    # a deterministic policy that still has a gradient, or a NaN gradient (the nonfinite rule's), is not dead
    learning = [_line(s, **(dead | {"grad_norm": 0.5})) for s in range(1, 6)]
    assert _feed(HealthMonitor(HealthConfig()), learning) == [[]] * 5
    assert _feed(HealthMonitor(HealthConfig()), [_line(s, **(dead | {"grad_norm": math.nan, "skipped_step": 1.0}))
                                                  for s in range(1, 3)]) == [["nonfinite"]] * 2


def test_reward_collapse_fires_on_a_fall_from_its_best_above_the_floor():
    cfg = HealthConfig(reward_smooth=2, reward_drop=0.5, warmup=1)
    rewards = [0.6, 0.6, 0.6, 0.2, 0.1]  # 2-step means from step 2: 0.6, 0.6, 0.4, 0.15 < 0.3
    assert _feed(HealthMonitor(cfg), [_line(i + 1, **{"reward/mean": r}) for i, r in enumerate(rewards)]) == [
        [], [], [], [], ["reward_collapse"]]
    tiny = [0.04, 0.04, 0.0, 0.0, 0.0]  # the best never reaches reward_floor (0.05): noise, not a collapse
    assert _feed(HealthMonitor(cfg), [_line(i + 1, **{"reward/mean": r}) for i, r in enumerate(tiny)]) == [[]] * 5


def test_the_ess_rule_needs_a_weak_gradient_unless_told_otherwise():
    low = [_line(s, **{"ess/ratio": 0.1, "grad_norm": 2.0}) for s in range(1, 31)]
    assert _feed(HealthMonitor(HealthConfig()), low) == [[]] * 30  # a full-VCPO run: low ESS, strong gradient
    fired = _feed(HealthMonitor(HealthConfig(ess_grad_below=None)), low)
    assert fired.index(["ess"]) == 19  # from step 20 (trainer.health.warmup)
    weak = [_line(s, **{"ess/ratio": 0.1, "grad_norm": 0.8}) for s in range(1, 31)]
    monitor = HealthMonitor(HealthConfig())
    assert _feed(monitor, weak)[19] == ["ess"]
    assert monitor.metrics["health/alarm_ess"] == 1.0
    assert _feed(HealthMonitor(HealthConfig(disabled=["ess"])), weak) == [[]] * 30


def test_accuracy_fall_needs_consecutive_evaluations_beyond_their_noise():
    def evals(accs, n):
        return [_line(1, **{"eval/accuracy_initial": accs[0], "eval/accuracy": accs[1], "eval/problems": n})] + [
            _line(i + 2, **{"eval/accuracy": a, "eval/problems": n}) for i, a in enumerate(accs[2:])]

    assert _feed(HealthMonitor(HealthConfig()), evals([0.4, 0.45, 0.1, 0.1, 0.1], 500)) == [
        [], [], ["accuracy_fall"], ["accuracy_fall"]]
    assert _feed(HealthMonitor(HealthConfig()), evals([0.4, 0.45, 0.1, 0.3, 0.1], 500)) == [[]] * 4  # recovered
    assert _feed(HealthMonitor(HealthConfig()), evals([0.0625, 0.0, 0.0, 0.0], 16)) == [[]] * 3  # 1 of 16, then 0


def test_the_monitor_state_survives_a_checkpoint_and_a_rollback_keeps_the_totals():
    dead = {"grad_norm": 0.0, "response/logprob_mean": 0.0}
    monitor = HealthMonitor(HealthConfig())
    _feed(monitor, [_line(1), _line(2, **dead), _line(3, **dead)])
    saved = json.loads(json.dumps(monitor.state()))
    assert [a.rule for a in HealthMonitor(HealthConfig(), saved).observe(_line(4, **dead))] == ["dead_policy"]
    monitor.observe(_line(4, **dead))
    monitor.rolled_back(saved, 0.5)
    assert (monitor.rollbacks, monitor.lr_factor, monitor.counts["dead_policy"]) == (1, 0.5, 1)
    assert monitor.summary() == {"alarms": dict.fromkeys(RULES, 0) | {"dead_policy": 1}, "rollbacks": 1,
                                 "lr_factor": 0.5}


LR_1E3 = ["async.mode=sync", "trainer.lr=1e3", "trainer.max_steps=12"]
"""The issue's run, on the tiny quickstart (its SFT warm start, batches and evaluations cut short)."""


def test_lr_1e3_warns_within_5_steps_and_stop_exits_3_with_the_last_healthy_checkpoint(tmp_path, tiny):
    run = tmp_path / "warn"
    proc = vcpo("train", *tiny, *LR_1E3, f"run_dir={run}", check=False)
    lines = metrics(run)
    first = next(m["step"] for m in lines if any(v for k, v in m.items() if "alarm" in k))
    assert first <= 5, proc.stderr
    assert f"health alarm at step {first}: " in proc.stderr
    run = tmp_path / "stop"
    proc = vcpo("train", *tiny, *LR_1E3, f"run_dir={run}", "trainer.on_alarm=stop", check=False)
    assert proc.returncode == HealthAlarm.EXIT_CODE == 3, proc.stderr
    stopped = metrics(run)[-1]["step"]
    assert stopped <= 5 and (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped - 1:06d}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"].startswith("stopped: health alarm (") and sum(summary["alarms"].values()) >= 1
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: stopped at step {stopped}: health alarm")


# A fault injected into the learner: from step 3 on, one gradient entry is NaN while the learning rate is above 6e-4
# (a step that diverges at a high rate only), so that halving the tiny config's 1e-3 cures it.
NAN_GRADIENT_AT_HIGH_LR = """
import math, sys
from vcpo.train.learner import Learner
backward = Learner.backward
def backward_with_a_nan(self, batch):
    metrics = backward(self, batch)
    if self.version >= 2 and self.lr > 6e-4:
        next(p for p in self.model.parameters() if p.grad is not None).grad.view(-1)[0] = math.nan
    return metrics
Learner.backward = backward_with_a_nan
from vcpo.cli import main
sys.argv[0] = "vcpo"
main()
"""


def test_rollback_halves_the_learning_rate_and_recovers(tmp_path, tiny):
    run = tmp_path / "run"
    proc = vcpo("train", *tiny, f"run_dir={run}", "async.mode=sync", "trainer.max_steps=8", "trainer.on_alarm=rollback",
                "trainer.health.disabled=[accuracy_fall]", python=["-c", NAN_GRADIENT_AT_HIGH_LR])
    assert "health alarm at step 3: nonfinite" in proc.stderr
    assert "health: rolled back to step 1 (step_000001) after the health alarm (nonfinite) at step 3; learning rate " \
           "0.001 -> 0.0005 (rollback 1 of at most 3)" in proc.stderr
    lines = metrics(run)
    assert [m["step"] for m in lines] == list(range(1, 9))  # the rolled-back steps' lines are gone
    assert [m["lr"] for m in lines] == [1e-3] + [5e-4] * 7 and not any(m["skipped_step"] for m in lines)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["rollbacks"], summary["lr_factor"]) == ("completed", 1, 0.5)
    assert summary["alarms"]["nonfinite"] == 1 and summary["skipped_steps"] == 1
    assert "health alarms 1 (nonfinite 1), rollbacks 1 (learning rate x0.5)" in proc.stderr.splitlines()[-1]


def test_a_guarded_lagged_run_resumes_to_the_metrics_of_an_unguarded_one(tmp_path, tiny, lagged_full):
    """on_alarm=rollback checkpoints every step (with the monitor's state); with no alarm, a lagged run stopped
    after step 2 and resumed still reproduces the uninterrupted warn-mode run metric for metric."""
    run = tmp_path / "run"
    vcpo("train", *tiny, *LAGGED, f"run_dir={run}", "trainer.on_alarm=rollback", "trainer.max_steps=2")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001", "step_000002"]
    vcpo("train", "--resume", str(run), "trainer.max_steps=4")

    def without_times(run_dir) -> list[dict]:
        return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics(run_dir)]

    assert without_times(run) == without_times(lagged_full)
    assert "health/alarm_ess" in metrics(run)[-1]
