"""Fault injection: kill -9 of the trainer (async and lagged) and of a rollout worker at random moments,
SIGTERM, and a full disk; after each, resume to the end and check that no step was lost or repeated, that
lagged metrics equal an uninterrupted run's, and that no process or shared-memory segment was left over.

    python benchmarks/fault_injection.py --kills 20 --sigterms 5 --startup-sigterms 3

Kills of the trainer and of a worker, and most SIGTERMs, come during training: once the metrics file has a
random number of lines L (1 to 39 of 40 steps), after a further delay uniform over one step of an
uninterrupted run, so that they land anywhere in a step (waiting for rollouts, the update, publishing
weights, every 10th an evaluation, every 5th a checkpoint write) whatever the machine's load. Start-up
SIGTERMs come at a moment uniform over an uninterrupted run's start-up (imports, model load, first
evaluation, worker start). The full disk is a tmpfs (root only) just too small for a third checkpoint,
grown again before the resume. One trial at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vcpo.testing.faults import alive, command_env, descendants, line_count, shm_segments, start_train, worker_pids

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 40
MODES = {"async": ["async.mode=async", "async.max_staleness=2"],
         "lagged": ["async.mode=lagged", "async.max_staleness=2"]}


def base_overrides(cache: Path) -> list[str]:
    return ["-c", "configs/quickstart.yaml", f"sft.cache_dir={cache}", "sft.steps=30", "sft.batch_size=32",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "task.eval_size=32",
            "trainer.eval_every=10", "trainer.checkpoint_every=5", "logging.progress=false", "trainer.lr=1e-3",
            f"trainer.max_steps={MAX_STEPS}"]


class Watched:
    """A `vcpo train` process whose descendants and shared-memory segments are recorded while it runs."""

    def __init__(self, args: list[str], log: Path, run_dir: Path) -> None:
        self.log = log
        self.metrics = run_dir / "metrics.jsonl"
        self.started = time.monotonic()
        self.proc = start_train(args, log, ROOT)
        self.family: set[int] = set()
        self.segments: set[str] = set()
        self.first_line_at: float | None = None

    def watch(self, seconds: float, until_lines: int | None = None) -> None:
        """Record the family for ``seconds`` (or until the process ends, or its metrics file has ``until_lines``)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and self.proc.poll() is None:
            kids = descendants(self.proc.pid)
            self.family.update(kids)
            self.segments |= shm_segments([self.proc.pid, *kids])
            count = line_count(self.metrics)
            if self.first_line_at is None and count > 0:
                self.first_line_at = time.monotonic()
            if until_lines is not None and count >= until_lines:
                return
            time.sleep(0.02)

    def wait(self) -> int:
        while self.proc.poll() is None:
            self.watch(1.0)
        return self.proc.returncode

    def leftovers(self, grace_s: float = 30.0) -> tuple[list[int], list[str]]:
        """(processes, /dev/shm files) of this run still there ``grace_s`` after it ended."""
        deadline = time.monotonic() + grace_s
        while [p for p in self.family if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the resource tracker unlinks leaked semaphores on its way out
        orphans = [p for p in self.family if alive(p)]
        for pid in orphans:  # report, then clean up, so that one failure does not spoil the next trial
            os.kill(pid, signal.SIGKILL)
        return orphans, sorted(s for s in self.segments if os.path.exists(s))

    def last_line(self) -> str:
        lines = [line for line in self.log.read_text().splitlines() if line.strip()]
        return lines[-1] if lines else ""


def steps_of(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def without_times(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in lines]


def finish(run_dir: Path, args: list[str], logs: Path) -> dict:
    """Resume (or, when the interrupted start left no run directory, start afresh) until the run completes."""
    orphans = segments = 0
    for attempt in range(1, 4):
        cmd = ["--resume", str(run_dir)] if (run_dir / "config.yaml").is_file() else args
        run = Watched(cmd, logs / f"resume-{attempt}.txt", run_dir)
        code = run.wait()
        left = run.leftovers()
        orphans, segments = orphans + len(left[0]), segments + len(left[1])
        if code == 0:
            break
    return {"resumes": attempt, "final_exit": code, "resume_orphans": orphans, "resume_leftover_shm": segments}


def trial(kind: str, mode: str, moment: tuple[int, float], work: Path, base: list[str],
          reference: list[dict] | None) -> dict:
    """One interruption (``kind``: trainer, worker or sigterm) at ``moment`` = (metrics lines L, then seconds;
    L = 0: seconds from the command's start), then resume to the end and check."""
    run_dir = work / "run"
    args = [*base, *MODES[mode], f"run_dir={run_dir}"]
    run = Watched(args, work / "interrupted.txt", run_dir)
    lines, delay_s = moment
    result: dict = {"kind": kind, "mode": mode, "phase": "training" if lines else "startup", "after_lines": lines,
                    "delay_s": round(delay_s, 3)}
    run.watch(600, until_lines=lines)
    run.watch(delay_s)
    try:
        if run.proc.poll() is None:
            target = worker_pids(run.proc.pid, timeout_s=5)[0] if kind == "worker" else run.proc.pid
            os.kill(target, signal.SIGTERM if kind == "sigterm" else signal.SIGKILL)
            result["killed"] = True
    except (TimeoutError, ProcessLookupError):  # the run ended just before the moment
        pass
    result["exit"] = run.wait()
    result["steps_at_interrupt"] = len(steps_of(run_dir))
    result["last_line"] = run.last_line()
    latest = run_dir / "checkpoints" / "latest"
    result["checkpoint_at_interrupt"] = int(latest.read_text().split("_")[1]) if latest.is_file() else 0
    orphans, segments = run.leftovers()
    result |= {"orphans": len(orphans), "leftover_shm": len(segments)}
    result |= finish(run_dir, args, work) if result["exit"] != 0 else {"resumes": 0, "final_exit": 0}
    steps = steps_of(run_dir)
    expected = list(range(1, MAX_STEPS + 1))
    result["steps_ok"] = steps == expected
    result["lost_or_repeated"] = len(set(expected) ^ set(steps)) + len(steps) - len(set(steps))
    if reference is not None and result["steps_ok"]:
        result["metrics_equal"] = without_times(run_dir) == reference
    if (run_dir / "summary.json").is_file():
        result["worker_restarts"] = json.loads((run_dir / "summary.json").read_text())["worker_restarts"]
    return result


def full_disk_trial(work: Path, base: list[str], size_mb: int) -> dict:
    """Checkpoints (about 5 MB each) on a tmpfs of ``size_mb``: the third does not fit. Then grow it and resume."""
    disk = work / "disk"
    disk.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(disk)], check=True)
    try:
        run_dir = disk / "run"
        args = [*base, *MODES["lagged"], f"run_dir={run_dir}"]
        run = Watched(args, work / "interrupted.txt", run_dir)
        result = {"kind": "full disk", "mode": "lagged", "exit": run.wait(), "last_line": run.last_line(),
                  "steps_at_interrupt": len(steps_of(run_dir))}
        result["checkpoints_left"] = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        subprocess.run(["mount", "-o", "remount,size=256m", str(disk)], check=True)
        result |= finish(run_dir, args, work)
        result["steps_ok"] = steps_of(run_dir) == list(range(1, MAX_STEPS + 1))
        return result
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="random moments per kill scenario")
    parser.add_argument("--sigterms", type=int, default=5, help="SIGTERMs per mode during training")
    parser.add_argument("--startup-sigterms", type=int, default=3, help="SIGTERMs per mode during start-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disk-mb", type=int, default=13, help="tmpfs size of the full-disk trial (0: skip it)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "fault_injection.json")
    opts = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="vcpo-faults-"))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped benchmark still cleans up (finally)
    try:
        results = run_trials(opts, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    opts.out.write_text(json.dumps(results, indent=1))
    summarize(results["results"])


def run_trials(opts: argparse.Namespace, root: Path) -> dict:
    rng = random.Random(opts.seed)
    base = base_overrides(root / "cache")
    warm = subprocess.run([sys.executable, "-m", "vcpo.cli", "sft", *base], cwd=ROOT, env=command_env(),
                          capture_output=True, text=True)  # the warm start once, so that no timed run pays it
    assert warm.returncode == 0, warm.stderr
    spans, references = {}, {}
    for mode in MODES:  # uninterrupted runs: the time span of each phase, and the lagged reference metrics
        ref = root / f"reference-{mode}"
        ref.mkdir()
        run = Watched([*base, *MODES[mode], f"run_dir={ref / 'run'}"], ref / "log.txt", ref / "run")
        assert run.wait() == 0, run.last_line()
        spans[mode] = {"startup": run.first_line_at - run.started, "training": time.monotonic() - run.first_line_at}
        references[mode] = without_times(ref / "run") if mode == "lagged" else None
    plan = [("trainer", "async", "training", opts.kills), ("trainer", "lagged", "training", opts.kills),
            ("worker", "async", "training", opts.kills), ("sigterm", "async", "training", opts.sigterms),
            ("sigterm", "lagged", "training", opts.sigterms), ("sigterm", "async", "startup", opts.startup_sigterms),
            ("sigterm", "lagged", "startup", opts.startup_sigterms)]
    results = []
    for kind, mode, phase, n in plan:
        step_s = spans[mode]["training"] / MAX_STEPS
        for i in range(n):
            work = root / f"{kind}-{mode}-{phase}-{i}"
            work.mkdir()
            if phase == "training":
                moment = (rng.randint(1, MAX_STEPS - 1), rng.uniform(0.0, step_s))
            else:
                moment = (0, rng.uniform(0.0, spans[mode]["startup"]))
            results.append(trial(kind, mode, moment, work, base, references[mode]))
            print(json.dumps(results[-1]), flush=True)
            shutil.rmtree(work, ignore_errors=True)
    if opts.disk_mb and os.geteuid() == 0:
        results.append(full_disk_trial(root / "disk-trial", base, opts.disk_mb))
        print(json.dumps(results[-1]), flush=True)
    return {"spans_s": spans, "results": results}


def summarize(results: list[dict]) -> None:
    print("\n| scenario (mode, phase) | trials | interrupted | resumed to the end | steps lost or repeated "
          "| lagged metrics equal | SIGTERM: every finished step checkpointed | orphan processes "
          "| leftover /dev/shm files |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in sorted({(r["kind"], r["mode"], r.get("phase", "-")) for r in results}):
        rs = [r for r in results if (r["kind"], r["mode"], r.get("phase", "-")) == key]
        equal = [r["metrics_equal"] for r in rs if "metrics_equal" in r]
        orphans = sum(r.get("orphans", 0) + r.get("resume_orphans", 0) for r in rs)
        shm = sum(r.get("leftover_shm", 0) + r.get("resume_leftover_shm", 0) for r in rs)
        interrupted = sum(bool(r.get("killed")) or r["exit"] != 0 for r in rs)
        stopped = [r["checkpoint_at_interrupt"] == r["steps_at_interrupt"] for r in rs if r["exit"] == 143]
        print(f"| {key[0]} ({key[1]}, {key[2]}) | {len(rs)} | {interrupted} "
              f"| {sum(r['final_exit'] == 0 and r['steps_ok'] for r in rs)} "
              f"| {sum(r.get('lost_or_repeated', 0) for r in rs)} | {f'{sum(equal)}/{len(equal)}' if equal else '-'} "
              f"| {f'{sum(stopped)}/{len(stopped)}' if stopped else '-'} | {orphans} | {shm} |")


if __name__ == "__main__":
    main()
