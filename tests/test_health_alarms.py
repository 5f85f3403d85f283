"""Health alarms (issues 26, 35): each rule on hand-made metric streams of its failure, the monitor's checkpointed
state, and through the real command line: runs pushed over the edge in several ways (learning rates 1e1 to 1e4, a
NaN gradient, rewards forced to 0, a sampler forced to uniform) each raise an alarm within 5 steps, whatever way
this CPU diverges, `trainer.on_alarm=stop` exits 3 keeping only checkpoints no alarm suspects, the summary says a
run ended worse than it started, and `rollback` recovers a run whose gradient turns NaN while the learning rate is
high."""

from __future__ import annotations

import json
import math

import pytest

from vcpo.config import HealthConfig
from vcpo.errors import HealthAlarm
from vcpo.loop.alarms import RULES, HealthMonitor, accuracy_verdict

from conftest import LAGGED, NAN_GRADIENT_FROM_STEP_2, metrics, patched_cli, vcpo


def _line(step: int, **values) -> dict:
    base = {"step": step, "reward/mean": 0.5, "reward/std": 0.5, "batch/groups": 16.0, "ess/ratio": 0.9,
            "grad_norm": 1.0, "response/logprob_mean": -0.6, "reward/zero_var_group_frac": 0.25,
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


def test_a_policy_turned_uniform_fires_on_its_entropy_near_ln_v_or_far_above_the_first_step():
    # a 103-token vocabulary: ln 103 = 4.635; 0.9 x 4.635 = 4.171. The issue's run: 0.69 at step 1, 4.635 from step 2
    uniform = {"response/logprob_mean": -4.635}
    fired = _feed(HealthMonitor(HealthConfig(), vocab_size=103), [_line(1, **{"response/logprob_mean": -0.69}),
                                                                  _line(2, **uniform), _line(3, **uniform)])
    assert fired == [[], [], ["uniform_policy"]]
    monitor = HealthMonitor(HealthConfig(), vocab_size=103)
    _feed(monitor, [_line(1, **{"response/logprob_mean": -0.69}), _line(2, **uniform)])
    (alarm,) = monitor.observe(_line(3, **uniform))
    assert alarm.last_good == 0  # step 2's rollouts came from step 1's weights: those are already suspect
    assert "sampled-token entropy 4.63 nats (100% of a uniform policy's) against 0.69" in alarm.line()
    # a sampler uniform from the start while the policy is not (the learner's own entropy, 0.69, is far below): no
    # rise, but at ln V from step 1
    broken = uniform | {"entropy/mean": 0.69}
    assert _feed(HealthMonitor(HealthConfig(), vocab_size=103), [_line(1, **broken), _line(2, **broken)]) == [
        [], ["uniform_policy"]]
    # without a vocabulary size, a rise of more than 2 nats (0.6 -> 2.7) for 2 steps; a rise of 1.9 is not one
    rise = [_line(1), _line(2, **{"response/logprob_mean": -2.7}), _line(3, **{"response/logprob_mean": -2.7})]
    assert _feed(HealthMonitor(HealthConfig()), rise) == [[], [], ["uniform_policy"]]
    mild = [_line(s, **{"response/logprob_mean": -0.6 - 1.9 * (s > 1)}) for s in range(1, 8)]
    assert _feed(HealthMonitor(HealthConfig(), vocab_size=103), mild) == [[]] * 7
    # a large vocabulary's healthy entropy (2 nats of ln 151936 = 11.9) is far from uniform
    big = [_line(s, **{"response/logprob_mean": -2.0}) for s in range(1, 8)]
    assert _feed(HealthMonitor(HealthConfig(), vocab_size=151936), big) == [[]] * 7


def test_a_policy_that_starts_near_uniform_is_judged_once_it_has_left_that_level():
    # a fresh model at a high temperature: the sampled tokens' entropy and the policy's own at ln 103 = 4.635 (>=
    # 0.9 ln V = 4.171) from step 1 is its start, not a blow-up; it learns (down to 2.0), then blows up again
    fresh = [_line(s, **{"response/logprob_mean": -4.6, "entropy/mean": 4.62}) for s in range(1, 6)]
    assert _feed(HealthMonitor(HealthConfig(), vocab_size=103), fresh) == [[]] * 5
    no_learner_entropy = [_line(s, **{"response/logprob_mean": -4.6}) for s in range(1, 6)]  # the estimate alone
    assert _feed(HealthMonitor(HealthConfig(), vocab_size=103), no_learner_entropy) == [[]] * 5
    learned = [_line(6, **{"response/logprob_mean": -2.0}), _line(7, **{"response/logprob_mean": -4.6}),
               _line(8, **{"response/logprob_mean": -4.6})]
    monitor = HealthMonitor(HealthConfig(), vocab_size=103)
    assert _feed(monitor, no_learner_entropy + learned) == [[]] * 7 + [["uniform_policy"]]
    # the lowest level seen survives a checkpoint
    resumed = HealthMonitor(HealthConfig(), monitor.state(), vocab_size=103)
    assert resumed.entropy_low == 2.0


SOLVED = {"reward/mean": 1.0, "reward/std": 0.0, "reward/zero_var_group_frac": 1.0, "grad_norm": 0.0,
          "response/logprob_mean": -1e-6}
"""A run that has solved its prompts: every group all correct, a near-deterministic policy, no gradient."""


def test_a_solved_run_is_saturated_not_dead_nor_silent_and_says_so_once():
    monitor = HealthMonitor(HealthConfig())
    fired, notices, saturated = [], [], []
    for s in range(1, 9):
        fired.append([a.rule for a in monitor.observe(_line(s, **(SOLVED if s > 1 else {})))])
        notices.append(list(monitor.notices))
        saturated.append(monitor.metrics["health/saturated"])
    assert fired == [[]] * 8  # neither no_signal nor dead_policy, whose conditions hold from step 2
    assert saturated == [0.0] + [1.0] * 7
    assert [s for s, n in enumerate(notices, 1) if n] == [4]  # after no_signal_steps (3) saturated steps, once
    assert notices[3][0].startswith("health notice at step 4: saturated: every reward was the maximum (1)")
    assert not any("alarm" in k and v for k, v in monitor.metrics.items())
    # the maximum is the config's: with rewards in [0, 2], all at 1 is stuck, not solved
    assert _feed(HealthMonitor(HealthConfig(max_reward=2.0)), [_line(s, **SOLVED) for s in range(1, 5)])[-1] == [
        "dead_policy", "no_signal"]


def test_a_stuck_run_still_alarms_all_wrong_or_partly_solved():
    # every group all wrong, or 15 of 16 groups solved and one all wrong (mean 0.9375): every group ties, no gradient
    for reward, std in ((0.0, 0.0), (0.9375, 0.242)):
        stuck = SOLVED | {"reward/mean": reward, "reward/std": std}
        fired = _feed(HealthMonitor(HealthConfig(reward_floor=1.0)), [_line(s, **stuck) for s in range(1, 5)])
        assert fired == [[], [], ["dead_policy", "no_signal"], ["dead_policy", "no_signal"]], reward


def test_no_signal_fires_when_every_group_ties_and_nothing_moves_for_its_streak():
    silent = {"reward/mean": 0.0, "reward/std": 0.0, "reward/zero_var_group_frac": 1.0, "grad_norm": 0.0}
    fired = _feed(HealthMonitor(HealthConfig(reward_floor=1.0)), [_line(1), _line(2)] + [
        _line(s, **silent) for s in range(3, 7)])
    assert fired == [[], [], [], [], ["no_signal"], ["no_signal"]]
    monitor = HealthMonitor(HealthConfig(reward_floor=1.0))
    _feed(monitor, [_line(1), _line(2), _line(3, **silent), _line(4, **silent)])
    (alarm,) = monitor.observe(_line(5, **silent))
    assert alarm.last_good == 1 and "no learning signal" in alarm.line()
    # tied groups with a gradient (another objective's term), or a gradient of 0 with varied rewards: not silent
    assert _feed(HealthMonitor(HealthConfig()), [_line(s, **(silent | {"grad_norm": 0.3})) for s in range(1, 6)]
                 )[-1] != ["no_signal"]
    assert _feed(HealthMonitor(HealthConfig()), [_line(s, grad_norm=0.0) for s in range(1, 6)]) == [[]] * 5


def test_reward_collapse_also_fires_early_against_the_first_step_beyond_noise():
    # step 1: 0.367 (std 0.482 over 16 groups, each one sample: se 0.1205); then 0.004 a step (se 0.0155): the mean
    # of 3 steps 0.004 < 0.5 x 0.367, and 0.363 > 2 sqrt(0.1205^2 + 3 x 0.0155^2 / 9) = 0.242
    lines = [_line(1, **{"reward/mean": 0.367, "reward/std": 0.482})] + [
        _line(s, **{"reward/mean": 0.004, "reward/std": 0.062}) for s in range(2, 6)]
    monitor = HealthMonitor(HealthConfig())
    assert _feed(monitor, lines) == [[], [], [], ["reward_collapse"], ["reward_collapse"]]
    assert monitor.counts["reward_collapse"] == 2
    monitor = HealthMonitor(HealthConfig())
    _feed(monitor, lines[:3])
    (alarm,) = monitor.observe(lines[3])
    assert alarm.last_good == 0 and "the first step's 0.367 (beyond two standard errors, 0.242)" in alarm.line()
    # the same fall over 4 groups a step is within noise (se 0.241, noise 0.48); a start below reward_floor never
    # counts
    noisy = [line | {"batch/groups": 4.0} for line in lines]
    assert _feed(HealthMonitor(HealthConfig()), noisy) == [[]] * 5
    low = [_line(1, **{"reward/mean": 0.04, "reward/std": 0.2})] + [
        _line(s, **{"reward/mean": 0.0, "reward/std": 0.0}) for s in range(2, 6)]
    assert _feed(HealthMonitor(HealthConfig(no_signal_steps=99)), low) == [[]] * 5
    # a healthy stream that wanders around its start never fires
    wander = [_line(s, **{"reward/mean": 0.35 + 0.1 * math.sin(s), "reward/std": 0.48}) for s in range(1, 60)]
    assert _feed(HealthMonitor(HealthConfig()), wander) == [[]] * 59


def test_accuracy_fall_at_the_final_evaluation_needs_no_streak_but_noise_still_counts():
    first = _line(1, **{"eval/accuracy_initial": 0.26, "eval/problems": 50})
    fell = _line(30, **{"eval/accuracy": 0.0, "eval/problems": 50})
    monitor = HealthMonitor(HealthConfig())
    monitor.observe(first)
    (alarm,) = monitor.observe(fell, final=True)
    assert alarm.rule == "accuracy_fall" and alarm.last_good == 0 and "at the final evaluation" in alarm.line()
    monitor = HealthMonitor(HealthConfig())
    monitor.observe(first)
    assert monitor.observe(fell) == []  # a single low evaluation mid-run waits for the next
    # 1 of 16 right, then none, at the final evaluation: within 2 sqrt(0.0625 x 0.9375 / 16) = 0.121
    monitor = HealthMonitor(HealthConfig())
    monitor.observe(_line(1, **{"eval/accuracy_initial": 0.0625, "eval/problems": 16}))
    assert monitor.observe(_line(8, **{"eval/accuracy": 0.0, "eval/problems": 16}), final=True) == []


def test_the_accuracy_verdict_says_worse_better_or_within_noise():
    # 0.26 -> 0 on 50 problems: 2 sqrt((0.26 x 0.74 + 0) / 50) = 0.124
    worse = accuracy_verdict(0.26, 0.0, 50)
    assert worse["verdict"] == "worse" and worse["accuracy_change"] == -0.26
    assert math.isclose(worse["accuracy_noise"], 2 * math.sqrt(0.26 * 0.74 / 50))
    assert accuracy_verdict(0.338, 0.378, 500)["verdict"] == "unchanged"  # noise 0.060
    assert accuracy_verdict(0.30, 0.40, 500)["verdict"] == "better"
    assert accuracy_verdict(None, 0.4, 50) == {"verdict": "unknown"}


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


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> list[str]:
    """The quickstart with its full SFT warm start (held-out accuracy about 0.3), synchronous, 64 samples a step,
    50 evaluation problems at the start and the end: a run healthy enough that a collapse is beyond noise."""
    cache = tmp_path_factory.mktemp("warm")
    return ["-c", "configs/quickstart.yaml", f"sft.cache_dir={cache}", "rollout.prompts_per_step=8",
            "rollout.group_size=8", "rollout.max_new_tokens=6", "task.eval_size=50", "trainer.eval_every=0",
            "logging.progress=false", "async.mode=sync", "trainer.max_steps=8"]


ZERO_REWARDS_FROM_STEP_3 = """
import dataclasses
from vcpo.orchestration.local import SyncSource
next_batch = SyncSource.next_batch
def zeroed(self, learner_version):
    batch = next_batch(self, learner_version)
    return [dataclasses.replace(t, reward=0.0) for t in batch] if learner_version >= 2 else batch
SyncSource.next_batch = zeroed
"""
UNIFORM_SAMPLER = """
import torch
import vcpo.rollout.engine as engine
sample_next = engine.sample_next
def uniform(logits_BV, sampling, generator=None, greedy=False):
    return sample_next(logits_BV if greedy else torch.zeros_like(logits_BV), sampling, generator, greedy)
engine.sample_next = uniform
"""
EDGES = {"lr_1e1": (["trainer.lr=1e1"], None), "lr_1e2": (["trainer.lr=1e2"], None),
         "lr_1e3": (["trainer.lr=1e3"], None), "lr_1e4": (["trainer.lr=1e4"], None),
         "nan_gradient": ([], NAN_GRADIENT_FROM_STEP_2), "zero_rewards_from_step_3": ([], ZERO_REWARDS_FROM_STEP_3),
         "uniform_sampler": ([], UNIFORM_SAMPLER)}
"""Ways to push a run over the edge: whichever way this CPU and BLAS diverge at a high learning rate (NaN, uniform
or deterministic), each must raise an alarm."""
SLOW_EDGES = {"lr_1e1", "lr_1e2", "lr_1e3"}
"""In the slow tier (`make test-slow`), not in `make test`, which keeps the highest rate and the forced failures."""


@pytest.mark.parametrize("edge", [pytest.param(e, marks=pytest.mark.slow) if e in SLOW_EDGES else e for e in EDGES])
def test_a_run_pushed_over_the_edge_alarms_within_5_steps_and_stop_keeps_only_healthy_checkpoints(
        tmp_path, warm, edge):
    overrides, patch = EDGES[edge]
    run = tmp_path / "run"
    proc = vcpo("train", *warm, *overrides, f"run_dir={run}", "trainer.on_alarm=stop", "trainer.max_skipped_steps=9",
                check=False, python=patched_cli(patch) if patch else None)
    assert proc.returncode == HealthAlarm.EXIT_CODE == 3, proc.stderr
    stopped = metrics(run)[-1]["step"]
    assert stopped <= 5 and f"health alarm at step {stopped}: " in proc.stderr, proc.stderr
    assert any(v for k, v in metrics(run)[-1].items() if "alarm" in k)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"].startswith("stopped: health alarm (") and sum(summary["alarms"].values()) >= 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: stopped at step {stopped}: health alarm")
    if edge.startswith("lr_"):  # the stopped run is evaluated as it ends: broken weights, worse beyond noise
        assert summary["verdict"] == "worse" and ", WORSE than before RL beyond noise (" in last, last
    # what remains resumable is older than the evidence: step t's line judges the weights of step t - 1
    ckpts = run / "checkpoints"
    kept = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_") and "." not in p.name)
    assert all(int(name.split("_")[1]) <= stopped - 2 for name in kept), (kept, proc.stderr)
    latest = ckpts / "latest"
    assert (latest.read_text().strip() == kept[-1]) if kept else not latest.exists()


def test_the_issues_run_warns_and_its_summary_says_it_ended_worse(tmp_path, warm):
    """lr = 1e3 with the default on_alarm=warn, run to its end: an alarm names what happened within 5 steps, the
    final evaluation's fall is judged, and the last line and summary.json say the run got worse beyond noise."""
    run = tmp_path / "run"
    proc = vcpo("train", *warm, "trainer.lr=1e3", "trainer.max_steps=6", "trainer.max_skipped_steps=9",
                f"run_dir={run}")
    lines = metrics(run)
    first = next(m["step"] for m in lines if any(v for k, v in m.items() if "alarm" in k))
    assert first <= 5 and f"health alarm at step {first}: " in proc.stderr
    assert "health alarm at step 6: accuracy_fall: " in proc.stderr and "at the final evaluation" in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["verdict"] == "worse", summary
    assert summary["accuracy_change"] < -summary["accuracy_noise"] < 0
    assert ", WORSE than before RL beyond noise (" in proc.stderr.strip().splitlines()[-1]


ALL_CORRECT = """
import dataclasses
from vcpo.orchestration.local import SyncSource
next_batch = SyncSource.next_batch
def solved(self, learner_version):
    return [dataclasses.replace(t, reward=1.0) for t in next_batch(self, learner_version)]
SyncSource.next_batch = solved
"""
"""A run that has solved its training prompts: every response correct from step 1."""


def test_a_solved_run_under_on_alarm_stop_completes_with_a_saturation_notice(tmp_path, warm):
    run = tmp_path / "run"
    proc = vcpo("train", *warm, f"run_dir={run}", "trainer.on_alarm=stop", "trainer.max_steps=5",
                python=patched_cli(ALL_CORRECT))
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5] and all(m["health/saturated"] == 1.0 for m in lines)
    assert not any(v for m in lines for k, v in m.items() if "alarm" in k)
    assert "health notice at step 3: saturated: every reward was the maximum (1)" in proc.stderr
    assert "health alarm at" not in proc.stderr
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


def test_a_fresh_model_at_a_high_temperature_is_no_uniform_policy(tmp_path):
    """No warm start (the embedded model as initialised) sampled at temperature 2: its sampled tokens' entropy sits at
    ln V from step 1, which is where it starts, not a blow-up (before issue 45: uniform_policy at step 2). Its rewards
    are all 0, so no_signal is right to fire."""
    run = tmp_path / "run"
    proc = vcpo("train", "-c", "configs/quickstart.yaml", f"sft.cache_dir={tmp_path / 'cache'}", "sft.steps=0",
                "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "task.eval_size=16",
                "trainer.eval_every=0", "logging.progress=false", "async.mode=sync", "trainer.max_steps=3",
                "rollout.temperature=2.0", f"run_dir={run}")
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all(m["health/entropy"] > 0.9 * math.log(103) for m in lines)  # near uniform throughout
    assert not any(m["health/alarm_uniform_policy"] for m in lines) and "uniform_policy" not in proc.stderr
    assert lines[-1]["health/alarm_no_signal"] == 1.0


# A fault injected into the learner: from step 3 on, one gradient entry is NaN while the learning rate is above 6e-4
# (a step that diverges at a high rate only), so that halving the tiny config's 1e-3 cures it.
NAN_GRADIENT_AT_HIGH_LR = """
import math
from vcpo.train.learner import Learner
backward = Learner.backward
def backward_with_a_nan(self, batch):
    metrics = backward(self, batch)
    if self.version >= 2 and self.lr > 6e-4:
        next(p for p in self.model.parameters() if p.grad is not None).grad.view(-1)[0] = math.nan
    return metrics
Learner.backward = backward_with_a_nan
"""


def test_rollback_halves_the_learning_rate_and_recovers(tmp_path, tiny):
    run = tmp_path / "run"
    proc = vcpo("train", *tiny, f"run_dir={run}", "async.mode=sync", "trainer.max_steps=8", "trainer.on_alarm=rollback",
                "trainer.health.disabled=[accuracy_fall]", python=patched_cli(NAN_GRADIENT_AT_HIGH_LR))
    assert "health alarm at step 3: nonfinite" in proc.stderr
    assert "health: rolled back to step 1 (step_000001) after the health alarm (nonfinite) at step 3; learning rate " \
           "0.001 -> 0.0005 (rollback 1 of at most 3)" in proc.stderr
    lines = metrics(run)
    assert [m["step"] for m in lines] == list(range(1, 9))  # the rolled-back steps' lines are gone
    trained = [json.loads(line) for line in (run / "trained_groups.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trained] == [t for t in range(1, 9) for _ in range(4)]  # and their groups' lines
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
