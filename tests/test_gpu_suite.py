"""The GPU checklist's one command (benchmarks/gpu_suite.py) in its quick CPU mode, so that it cannot rot without a
GPU: every part runs and the summary holds the step-cost table, the training table and each part's status; a part
that fails or runs out of time is reported as such and the others still run."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_suite


@pytest.mark.slow
def test_the_quick_suite_runs_every_part_and_writes_one_summary(tmp_path):
    out = tmp_path / "summary.md"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    text = out.read_text()
    assert proc.returncode == 0, text[-3000:]
    names = [p.name for p in gpu_suite.parts(True, tmp_path)]
    assert len(names) == 7
    for name in names:
        assert f"| {name} | ok |" in text
    assert "| vcpo_fast |" in text and "| vcpo_proxy_grad_only |" in text  # the step-cost table
    assert "(the goals are a GPU step: not judged here)" in text
    assert "| sync | 4 |" in text and "| async | 4 |" in text  # the training table


def test_a_failing_or_slow_part_is_reported_and_the_rest_go_on():
    deadline = time.monotonic() + 60
    failed = gpu_suite.run_part(gpu_suite.Part("fails", ["-c", "import sys; print('x'); sys.exit(4)"], 30), deadline)
    slow = gpu_suite.run_part(gpu_suite.Part("slow", ["-c", "import time; time.sleep(30)"], 1), deadline)
    fine = gpu_suite.run_part(gpu_suite.Part("fine", ["-c", "print('done')"], 30), deadline)
    assert (failed["status"], failed["output"].strip()) == ("failed (exit 4)", "x")
    assert slow["status"] == "timed out after 1 s" and slow["seconds"] < 10
    assert fine["status"] == "ok" and fine["output"].strip() == "done"
