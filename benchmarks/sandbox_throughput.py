"""How fast is run_python? Sandboxed runs per second, sequential and from 2 threads, next to a bare interpreter.

    python benchmarks/sandbox_throughput.py [--runs 40]

Arms, round-robin so that the machine's drift hits them alike:
- bare: ``subprocess.run([python, "-I", "-S", "-c", "pass"])`` (the floor: an interpreter's start and exit)
- sandbox: ``run_python("pass")`` with namespaces (as root: PID/net/mount/IPC namespaces, read-only view,
  own uid, Landlock, rlimits)
- fallback: ``run_python("pass", namespaces=False)`` (Landlock and rlimits only)
- sandbox, print: ``run_python("print(sum(range(10**6)))")`` (a small but real tool call)
Then 2 threads each doing ``--runs`` sandbox runs at once: aggregate runs per second.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

from vcpo.envs.sandbox import run_python

ARMS = {
    "bare interpreter": lambda: subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True),
    "sandbox": lambda: run_python("pass"),
    "fallback (no namespaces)": lambda: run_python("pass", namespaces=False),
    "sandbox, print(sum(range(1e6)))": lambda: run_python("print(sum(range(10**6)))"),
}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def threaded(threads: int, runs: int) -> float:
    """Aggregate sandbox runs per second with ``threads`` threads each doing ``runs`` runs."""

    def loop() -> None:
        for _ in range(runs):
            run_python("pass")

    workers = [threading.Thread(target=loop) for _ in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return threads * runs / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    print("isolation:", ", ".join(run_python("pass").isolation))
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for _ in range(args.runs):
        for name, fn in ARMS.items():
            times[name].append(timed(fn))
    bare = statistics.median(times["bare interpreter"])
    print(f"{'arm':34s} {'median ms':>10s} {'p90 ms':>8s} {'runs/s':>7s} {'x bare':>7s}")
    for name, ts in times.items():
        median, p90 = statistics.median(ts), statistics.quantiles(ts, n=10)[-1]
        print(f"{name:34s} {median * 1e3:10.1f} {p90 * 1e3:8.1f} {1 / median:7.1f} {median / bare:7.2f}")
    sequential = threaded(1, args.runs)
    parallel = threaded(2, args.runs)
    print(f"sandbox runs/s: sequential {sequential:.1f}, 2 threads {parallel:.1f} ({parallel / sequential:.2f}x)")


if __name__ == "__main__":
    main()
