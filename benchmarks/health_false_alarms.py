"""The live health monitor replayed over finished runs: in how many runs each rule fires, split by whether the run
collapsed (vcpo.study.collapse's definition), and how many runs ended worse than they started beyond noise.

A stable run that raises an alarm is a false alarm by the study's collapse definition. Each run directory holds
``metrics.jsonl`` and ``config.yaml`` (a committed study cell, or a run of ``vcpo train``).

Exported study cells keep only some metrics (vcpo.study.export): the replay fills in what they lack, and says so in
its output: the sampled-token entropy (``-response/logprob_mean``) from the learner's ``entropy/mean`` where that was
logged (the OPOB-fast arms did not log it: there ``uniform_policy`` cannot fire), and a step's reward standard
deviation from its mean as a binary reward's, ``sqrt(p (1 - p))``, and ``batch/groups`` as the prompts a step. The
vocabulary size is the default model's (the character tokenizer of the cell's task).

    python benchmarks/health_false_alarms.py benchmarks/staleness/{study2,study2_issue24,full}/cells
    python benchmarks/health_false_alarms.py runs/demo runs/tools          # whole run directories
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from pathlib import Path

import yaml

from vcpo.config import HealthConfig
from vcpo.loop.alarms import RULES, HealthMonitor, accuracy_verdict
from vcpo.metrics import read_metrics
from vcpo.study.collapse import collapse_point, eval_series


def run_dirs(paths: list[str]) -> list[Path]:
    """Every run under ``paths``: a directory with metrics.jsonl, or a directory of such directories."""
    found = []
    for path in map(Path, paths):
        found += [path] if (path / "metrics.jsonl").is_file() else sorted(
            p for p in path.iterdir() if (p / "metrics.jsonl").is_file())
    return found


def filled(record: dict, groups: int, eval_problems: int) -> tuple[dict, list[str]]:
    """A metrics line with what an exported cell lacks filled in (see the module's docstring), and what was."""
    out, made = dict(record), []
    if "response/logprob_mean" not in out and isinstance(out.get("entropy/mean"), int | float):
        out["response/logprob_mean"] = -out["entropy/mean"]
        made.append("entropy from entropy/mean")
    if "reward/std" not in out and isinstance(out.get("reward/mean"), int | float):
        p = min(max(out["reward/mean"], 0.0), 1.0)
        out["reward/std"], out["batch/groups"] = math.sqrt(p * (1 - p)), float(groups)
        made.append("reward/std as binary")
    if "eval/accuracy" in out or "eval/accuracy_initial" in out:
        out.setdefault("eval/problems", eval_problems)
    return out, made


def replay(run: Path, vocab_size: int) -> dict:
    """The rules that fired on one run (and on how many steps), whether it collapsed and its accuracy verdict."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    records = read_metrics(run / "metrics.jsonl")
    rollout, n_eval = config.get("rollout", {}), config["task"]["eval_size"]
    groups = rollout.get("prompts_per_step", 16)
    monitor, steps, made = HealthMonitor(HealthConfig(), vocab_size=vocab_size), Counter(), set()
    max_steps = config["trainer"]["max_steps"]
    for i, record in enumerate(records):
        line, filled_in = filled(record, groups, n_eval)
        made.update(filled_in)
        final = i == len(records) - 1 and int(record["step"]) == max_steps
        steps.update(a.rule for a in monitor.observe(line, final=final))
    evals = eval_series(records)
    return {"fired": steps, "collapsed": collapse_point(*evals) is not None, "made": made,
            "verdict": accuracy_verdict(evals[1][0], evals[1][-1], n_eval)["verdict"] if evals[1] else "unknown"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="run directories, or directories of them (study cells)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="the policy's vocabulary (default: the embedded default model's for chain_sum)")
    args = parser.parse_args()
    vocab = args.vocab_size or default_vocab_size()
    results = [(run, replay(run, vocab)) for run in run_dirs(args.paths)]
    print(f"{len(results)} runs; vocabulary {vocab}; filled in: "
          f"{', '.join(sorted(set().union(*(r['made'] for _, r in results)))) or 'nothing'}")
    print("| runs | count | " + " | ".join(RULES) + " | ended worse |")
    print("|---|---|" + "---|" * (len(RULES) + 1))
    for collapsed in (False, True):
        group = [r for _, r in results if r["collapsed"] == collapsed]
        fired = Counter(rule for r in group for rule in r["fired"])
        worse = sum(r["verdict"] == "worse" for r in group)
        print(f"| {'collapsed' if collapsed else 'stable'} | {len(group)} | "
              + " | ".join(str(fired[rule]) for rule in RULES) + f" | {worse} |")
    for run, r in results:
        if r["fired"] and not r["collapsed"]:
            print(f"  stable run with alarms: {run}: {dict(r['fired'])}")


def default_vocab_size() -> int:
    """The embedded default model's vocabulary on chain_sum (printable ASCII and the special tokens)."""
    from vcpo.config import TaskConfig
    from vcpo.models.default import BASE_CHARACTERS, build_char_tokenizer, task_characters
    from vcpo.tasks import make_task

    return len(build_char_tokenizer(BASE_CHARACTERS + task_characters(make_task(TaskConfig(name="chain_sum")), 0)))


if __name__ == "__main__":
    main()
