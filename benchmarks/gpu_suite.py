"""The GPU checklist in one command, with one markdown summary: the CUDA tests, OPOB's step cost against GRPO's
(fast norms and the logit proxy, every OPOB variant), learner memory at the 0.5B shape with 64 x 1,024 tokens,
rollout-engine throughput in float32 and bfloat16, training-inference mismatch with and without the float32 head,
and a warm-started model trained 50 synchronous and 50 asynchronous steps.

Each part runs as its own process under its own timeout (and all of them under ``--budget-s``); a part that fails,
runs out of memory or time is reported as such and the others go on. The summary (``--out``) starts with the
figures the issues set goals for, then each part's status, time and output.

    python benchmarks/gpu_suite.py --out gpu_summary.md            # on one GPU: about 8 minutes on an H100
    python benchmarks/gpu_suite.py --quick --out /tmp/summary.md   # the same parts on the CPU at toy sizes (CI)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"vcpo_fast": (1.2, 1.3), "vcpo_proxy_grad_only": (1.05, None)}
"""Arm: (largest step-time ratio to GRPO, largest peak-memory ratio) on a GPU (issue 36)."""
FAST_ARMS = "grpo,vcpo_fast,vcpo_fast_grad_only,vcpo_proxy_grad_only"
OTHER_ARMS = "grpo,vcpo_fast_leave_one_out,vcpo_proxy,vcpo_proxy_leave_one_out"


@dataclass
class Part:
    """One command of the checklist: its arguments (after the Python interpreter) and its timeout."""

    name: str
    argv: list[str]
    timeout_s: float
    env: dict[str, str] | None = None


def parts(quick: bool, out: Path, profile: list[str] | None = None) -> list[Part]:
    """The checklist: on a GPU at the sizes the issues name, or (``quick``) on the CPU at toy sizes; ``profile``:
    the step_overhead arms whose torch.profiler table to add at the end."""
    runs = out / "runs"
    tiny = ["sft.steps=30", "sft.batch_size=32", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "task.eval_size=16", "trainer.eval_every=0", "logging.progress=false"]
    if quick:
        device, dtype, setup, steps = "cpu", "float32", "default", 4
        train = [*tiny, "model.device=cpu", f"sft.cache_dir={out / 'cache'}"]
        return [
            Part("tests/gpu (on the CPU)", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", "-k",
                                           "lean or chunked or generator"], 120, {"VCPO_GPU_TESTS_DEVICE": "cpu"}),
            Part("step overhead", ["benchmarks/step_overhead.py", "--device", device, "--setups", setup, "--repeats",
                                   "2", "--arms", "grpo,vcpo_fast,vcpo_proxy_grad_only", "--json",
                                   str(out / "step_overhead_fast.json")], 120),
            Part("learner memory", ["benchmarks/learner_memory.py", "--device", device, "--setups", setup,
                                    "--micro-batch-tokens", "256", "--variants", "0,2"], 120),
            Part(f"engine throughput {dtype}", ["benchmarks/engine_throughput.py", "--device", device, "--dtype",
                                                dtype, "--setups", setup, "--repeats", "1"], 60),
            Part("mismatch", ["benchmarks/mismatch.py", f"model.device={device}", *tiny, f"sft.cache_dir="
                              f"{out / 'cache'}", "--steps", "2"], 120),
            *(Part(f"train {mode} {steps} steps", ["-m", "vcpo.cli", "train", "-c", "configs/quickstart.yaml", *train,
                                                   f"async.mode={mode}", f"trainer.max_steps={steps}",
                                                   f"run_dir={runs / mode}"], 120) for mode in ("sync", "async")),
        ]
    train = ["model.device=cuda", "logging.progress=false", "trainer.eval_every=25", "task.eval_size=200"]
    step = ["benchmarks/step_overhead.py", "--device", "cuda", "--dtype", "bfloat16", "--setups", "qwen05b"]
    return [  # most wanted first: a part the suite's budget cannot reach is reported as not run
        Part("tests/gpu", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "4", "tests/gpu"], 200),
        Part("step overhead", [*step, "--repeats", "6", "--arms", FAST_ARMS, "--json",
                               str(out / "step_overhead_fast.json")], 150),
        Part("learner memory", ["benchmarks/learner_memory.py", "--device", "cuda", "--dtype", "bfloat16",
                                "--setups", "qwen05b_1k", "--micro-batch-tokens", "16384"], 150),
        *(Part(f"engine throughput {dtype}", ["benchmarks/engine_throughput.py", "--device", "cuda", "--dtype", dtype,
                                              "--setups", "qwen05b", "--repeats", "2"], 60)
          for dtype in ("float32", "bfloat16")),
        Part("mismatch", ["benchmarks/mismatch.py", "model.device=cuda", "--steps", "10"], 90),
        *(Part(f"train {mode} 50 steps", ["-m", "vcpo.cli", "train", "-c", "configs/quickstart.yaml", *train,
                                          f"async.mode={mode}", "trainer.max_steps=50", f"run_dir={runs / mode}"], 90)
          for mode in ("sync", "async")),
        Part("step overhead, other variants", [*step, "--repeats", "4", "--arms", OTHER_ARMS, "--json",
                                               str(out / "step_overhead_other.json")], 100),
        *(Part(f"profile of a {arm} step", [*step, "--profile", arm], 60) for arm in (profile or [])),
    ]


def run_part(part: Part, deadline: float) -> dict:
    """Run one part under its timeout (cut to the suite's deadline); its status, seconds and output."""
    timeout = max(1.0, min(part.timeout_s, deadline - time.monotonic()))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(part.env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT / "benchmarks"),
                                                      env.get("PYTHONPATH")]))
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, *part.argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        status = f"timed out after {timeout:.0f} s"
        output = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    return {"name": part.name, "status": status, "seconds": time.monotonic() - t0, "output": output,
            "command": " ".join(["python", *part.argv])}


def headline(out: Path) -> list[str]:
    """The step-cost goals, from step_overhead's JSON files."""
    lines = []
    for path in sorted(out.glob("step_overhead_*.json")):
        data = json.loads(path.read_text())
        for setup, figures in data["setups"].items():
            on_gpu = data["meta"]["device"].startswith("cuda")
            lines.append(f"\n{setup} ({figures['params'] / 1e6:.2f}M parameters, {figures['rows']} rows), "
                         f"{data['meta']['dtype']}, {data['meta'].get('gpu', data['meta']['device'])}"
                         f"{'' if on_gpu else ' (the goals are a GPU step: not judged here)'}:\n")
            lines.append("| arm | median step (s) | x grpo | paired x | peak memory (MiB) | memory x grpo | goal |")
            lines.append("|---|---|---|---|---|---|---|")
            for arm, r in figures.items():
                if not isinstance(r, dict):
                    continue
                goal = GOALS.get(arm) if on_gpu else None
                verdict = ""
                if goal is not None:
                    met = r["x"] <= goal[0] and (goal[1] is None or r["mem_x"] <= goal[1])
                    verdict = (f"<= {goal[0]}x" + (f", <= {goal[1]}x memory" if goal[1] else "")
                               + (": met" if met else ": NOT met"))
                lines.append(f"| {arm} | {r['median_s']:.4f} | {r['x']:.2f} | {r['paired_x']:.2f} | "
                             f"{r['peak_mib']:.0f} | {r['mem_x']:.2f} | {verdict} |")
    return lines


def train_table(out: Path) -> list[str]:
    """Sync against async: accuracy before and after, and the median step time, from each run's files."""
    rows = []
    for run in sorted((out / "runs").glob("*")):
        summary_path = run / "summary.json"
        if not summary_path.is_file():
            continue
        summary = json.loads(summary_path.read_text())
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        times = sorted(m["time/step_s"] for m in steps)
        median = times[len(times) // 2] if times else float("nan")
        rows.append(f"| {run.name} | {summary['steps']} | {summary['initial_accuracy']:.3f} | "
                    f"{summary['final_accuracy']:.3f} | {median:.3f} | {summary['wall_time_s']:.0f} |")
    if not rows:
        return []
    return ["", "| mode | steps | held-out accuracy before | after | median step (s) | wall (s) |",
            "|---|---|---|---|---|---|", *rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_summary.md", help="the markdown summary to write")
    ap.add_argument("--quick", action="store_true", help="on the CPU at toy sizes, in a minute or two (CI)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="every part must end within this (seconds)")
    ap.add_argument("--only", default=None, help="comma-separated part names to run (default: all)")
    ap.add_argument("--profile", default=None, metavar="ARMS",
                    help="comma-separated step_overhead arms to profile at the end (e.g. grpo,vcpo_fast)")
    args = ap.parse_args()
    summary_path = Path(args.out).resolve()
    work = Path(tempfile.mkdtemp(prefix="vcpo-gpu-suite-"))
    todo = parts(args.quick, work, args.profile.split(",") if args.profile else None)
    if args.only:
        todo = [p for p in todo if p.name in args.only.split(",")]
    started, deadline = time.monotonic(), time.monotonic() + args.budget_s
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.quick else platform.processor()
    results = []
    for part in todo:
        if time.monotonic() >= deadline:
            results.append({"name": part.name, "status": "not run (suite budget spent)", "seconds": 0.0,
                            "output": "", "command": " ".join(["python", *part.argv])})
            continue
        results.append(run_part(part, deadline))
        print(f"{results[-1]['name']}: {results[-1]['status']} ({results[-1]['seconds']:.0f} s)", flush=True)
    lines = [f"# GPU checklist{' (quick mode, CPU)' if args.quick else ''}", "",
             f"{datetime.date.today().isoformat()}, {device or platform.machine()}, torch {torch.__version__}, "
             f"Python {platform.python_version()}; `python benchmarks/gpu_suite.py "
             f"{' '.join(sys.argv[1:])}`; {time.monotonic() - started:.0f} s in all.", "",
             "## Step cost against GRPO", *headline(work), "", "## Training, synchronous and asynchronous",
             *train_table(work), "", "## Parts", "", "| part | status | seconds |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['status']} | {r['seconds']:.0f} |" for r in results]
    for r in results:
        tail = "\n".join(r["output"].strip().splitlines()[-60:])
        lines += ["", f"### {r['name']}: {r['status']}", "", f"`{r['command']}`", "", "```", tail, "```"]
    summary_path.write_text("\n".join(lines) + "\n")
    print(f"summary: {summary_path}")
    sys.exit(0 if all(r["status"] == "ok" for r in results) else 1)


if __name__ == "__main__":
    main()
