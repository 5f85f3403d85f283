"""The gradient microscope (issue 24): how close each estimator's gradient comes, under staleness, to the
on-policy gradient at the learner.

A state: from a pinned warm start (theta_0), the learner takes K lagged steps of a training arm, exactly as a
lagged run with k = K does (its batches 0..K-1 are all sampled by theta_0), reaching theta_K. Then N stale
batches are sampled by theta_0 (problem batches K..K+N-1: lag K) and on-policy batches by theta_K on the same
problems (--ref-per-batch samplings of each, default 4: the reference costs one backward a batch). Every
estimator (a study arm, or VCPO with an OPOB variant / weighting / G method) computes its
gradient at theta_K on each stale batch through the real learner (Learner.backward: no clipping, no step), and
is compared with the reference, the mean on-policy gradient of --reference-arm (default vcpo_ess_only: the vcpo
objective with GRPO's mean baseline, whose expectation on-policy is the policy gradient every arm aims at):

    cos      cosine between the estimator's mean gradient over the N batches and the reference
    |g|/|ref| the mean gradient's norm relative to the reference's (conventions such as GRPO's sample std and
             OPOB's population std differ by sqrt(n/(n-1)), 1.069 for groups of 8)
    bias     ||mean - ref|| / ||ref||
    var      per-batch variance trace, sum_b ||g_b - mean||^2 / (N - 1), over ||ref||^2
    cos(term) for OPOB estimators: the cosine of the OPOB term, mean - sqrt(n/(n-1)) * mean(vcpo_ess_only) (the
             same objective with the mean baseline and OPOB's population std), with the reference
The header gives the reference's split-half cosine (two halves of the on-policy batches: its own noise floor).

    python benchmarks/gradient_quality.py                       # K = 16, warm start w0, seed 0 (a few minutes)
    python benchmarks/gradient_quality.py --ks 16,64 --warm-starts w0,w1 --seeds 0,1 --batches 24
    python benchmarks/gradient_quality.py -c my.yaml --warm-starts path/to/model rollout.group_size=16 ...
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path

import torch

from vcpo.config import Config, load_config
from vcpo.loop.trainer import seed_everything
from vcpo.models.loading import load_policy
from vcpo.orchestration.base import ProblemStream, generator_for
from vcpo.rollout.collect import collect_groups
from vcpo.rollout.engine import HFRolloutEngine
from vcpo.runtime import configure_cpu
from vcpo.study.grids import ARMS, STUDY2
from vcpo.tasks import make_task, prepare_scoring
from vcpo.train.learner import Learner
from vcpo.types import Batch, SamplingParams
from vcpo.variance import OPOB_VARIANTS, OPOB_WEIGHTINGS

ROOT = Path(__file__).resolve().parents[1]
WARM_STARTS = {name: str(ROOT / pin.path) for name, pin in STUDY2.warm_starts.items()}
G_METHODS = ("fast", "logit_proxy")


def estimators(arms: list[str]) -> dict[str, list[str]]:
    """Each estimator's overrides: the study arms, then VCPO with every OPOB variant x weighting x G method (the
    arm ``vcpo`` is ``plugin/paper/fast``; ``exact`` G equals ``fast`` to 1e-7 and is left out)."""
    out = {arm: list(ARMS[arm]) for arm in arms}
    for variant, weighting, method in product(OPOB_VARIANTS, OPOB_WEIGHTINGS, G_METHODS):
        name = f"opob {variant}/{weighting}/{method}"
        if not ("vcpo" in out and name == "opob plugin/paper/fast"):
            out[name] = [*ARMS["vcpo"], f"advantage.opob_variant={variant}", f"advantage.opob_weighting={weighting}",
                         f"advantage.grad_norm_method={method}"]
    return out


@dataclass
class Moments:
    """Running sum and sum of squared norms of flattened float64 gradients."""

    total: torch.Tensor | None = None
    sq_norms: float = 0.0
    n: int = 0
    halves: list[torch.Tensor] = field(default_factory=list)

    def add(self, g: torch.Tensor) -> None:
        self.total = g.clone() if self.total is None else self.total + g
        self.sq_norms += float(g.square().sum())
        self.n += 1

    @property
    def mean(self) -> torch.Tensor:
        return self.total / self.n

    @property
    def var_trace(self) -> float:
        return (self.sq_norms - self.n * float(self.mean.square().sum())) / max(self.n - 1, 1)


def flat_grad(learner: Learner, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    metrics = learner.backward(batch)
    return torch.cat([p.grad.reshape(-1).double() for p in learner.params]), metrics


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-300))


def sample_batches(model, tokenizer, task, config: Config, indices: range, gen_offset: int = 0) -> list[Batch]:
    """The lagged run's batches ``indices`` (its problems and sampling seeds; ``gen_offset`` draws other samples)."""
    rc = config.rollout
    engine = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
    stream = ProblemStream(task, config.seed, rc.prompts_per_step)
    sampling = SamplingParams(temperature=rc.temperature, top_p=rc.top_p, max_new_tokens=rc.max_new_tokens)
    P, out = rc.prompts_per_step, []
    for i in indices:
        groups = collect_groups(engine, tokenizer, task, stream.batch(i), list(range(i * P, (i + 1) * P)),
                                rc.group_size, sampling, generator_for(config.seed, i + gen_offset))
        out.append(Batch.from_trajectories([t for g in groups for t in g], pad_id=tokenizer.pad_token_id))
    return out


@dataclass
class State:
    """theta_K and its batches: the learner's model, N stale batches (from theta_0) and N on-policy ones."""

    model: torch.nn.Module
    tokenizer: object
    task: object
    stale: list[Batch]
    on_policy: list[Batch]
    train_s: float


def build_state(config_path: str | None, overrides: list[str], warm_start: str, seed: int, K: int, n_batches: int,
                train_arm: str, ref_per_batch: int = 4) -> tuple[State, Config]:
    base = [*overrides, f"model.path={WARM_STARTS.get(warm_start, warm_start)}", f"seed={seed}"]
    config = load_config(config_path, [*base, *ARMS[train_arm]])
    seed_everything(seed)
    task = make_task(config.task)
    prepare_scoring(task)
    model, tokenizer = load_policy(config.model.path, config.model.dtype, "cpu")
    t0 = time.perf_counter()
    batches = sample_batches(model, tokenizer, task, config, range(K + n_batches))  # all by theta_0
    learner = Learner(model, config)
    for t in range(K):
        learner.step(batches[t])
    train_s = time.perf_counter() - t0
    on_policy = [b for r in range(ref_per_batch) for b in sample_batches(
        model, tokenizer, task, config, range(K, K + n_batches), gen_offset=1_000_000_007 * (r + 1))]
    return State(model, tokenizer, task, batches[K:], on_policy, train_s), load_config(config_path, base)


def measure(state: State, base: Config, config_path: str | None, overrides: list[str], named: dict[str, list[str]],
            reference_arm: str) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Per estimator: cos, norm ratio, bias, variance (relative to the reference) and the OPOB term's cosine."""
    pinned = [f"model.path={base.model.path}", f"seed={base.seed}"]
    learners = {name: Learner(state.model, load_config(config_path, [*overrides, *pinned, *o]))
                for name, o in named.items()}
    ref_learner = Learner(state.model, load_config(config_path, [*overrides, *pinned, *ARMS[reference_arm]]))
    ref, halves = Moments(), [Moments(), Moments()]
    for i, b in enumerate(state.on_policy):
        g, _ = flat_grad(ref_learner, b)
        ref.add(g)
        halves[i % 2].add(g)
    moments = {name: Moments() for name in named}
    ess = []
    for b in state.stale:
        for name, learner in learners.items():
            g, metrics = flat_grad(learner, b)
            moments[name].add(g)
            if name == next(iter(learners)):
                ess.append(metrics["ess/ratio"])
    state.model.zero_grad(set_to_none=True)
    r, r2 = ref.mean, float(ref.mean.square().sum())
    n = base.rollout.group_size
    mean_baseline = moments["vcpo_ess_only"].mean * math.sqrt(n / (n - 1)) if "vcpo_ess_only" in moments else None
    rows = {}
    for name, m in moments.items():
        row = {"cos": cosine(m.mean, r), "norm": float(m.mean.norm()) / math.sqrt(r2),
               "bias": float((m.mean - r).norm()) / math.sqrt(r2), "var": m.var_trace / r2}
        if mean_baseline is not None and (name.startswith("opob") or name == "vcpo"):
            row["term"] = cosine(m.mean - mean_baseline, r)
        rows[name] = row
    header = {"ref_split_half_cos": cosine(halves[0].mean, halves[1].mean), "stale_ess_ratio": sum(ess) / len(ess),
              "stale_reward": float(torch.cat([b.rewards_B for b in state.stale]).mean()),
              "on_policy_reward": float(torch.cat([b.rewards_B for b in state.on_policy]).mean())}
    return rows, header


def table(rows: dict[str, dict[str, float]]) -> str:
    lines = ["| estimator | cos | \\|g\\|/\\|ref\\| | bias | var | cos(term) |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        term = f"{r['term']:+.3f}" if "term" in r else ""
        lines.append(f"| {name} | {r['cos']:+.3f} | {r['norm']:.3f} | {r['bias']:.3f} | {r['var']:.2f} | {term} |")
    return "\n".join(lines)


def summary(results: dict[tuple, dict[str, dict[str, float]]], K: int) -> str:
    """Cosine of each estimator in each state at one K, and the mean over states."""
    states = [s for s in results if s[2] == K]
    names = list(results[states[0]])
    head = " | ".join(f"{w} s{s}" for w, s, _ in states)
    lines = [f"| estimator (K = {K}) | {head} | mean |", "|---|" + "---|" * (len(states) + 1)]
    for name in names:
        cos = [results[s][name]["cos"] for s in states]
        lines.append(f"| {name} | " + " | ".join(f"{c:+.3f}" for c in cos) + f" | {sum(cos) / len(cos):+.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=str(ROOT / "configs/staleness_study.yaml"))
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, as vcpo train takes them")
    ap.add_argument("--ks", default="16", help="comma-separated lags K (default 16)")
    ap.add_argument("--warm-starts", default="w0", help=f"comma-separated: {', '.join(WARM_STARTS)} or model dirs")
    ap.add_argument("--seeds", default="0", help="comma-separated RL seeds (each a state with each warm start)")
    ap.add_argument("--batches", type=int, default=16, help="N stale (and N on-policy) batches per state")
    ap.add_argument("--ref-per-batch", type=int, default=4, help="on-policy batches per stale batch's problems")
    ap.add_argument("--train-arm", default="vcpo", choices=list(ARMS), help="the arm that takes the K lagged steps")
    ap.add_argument("--reference-arm", default="vcpo_ess_only", choices=list(ARMS))
    ap.add_argument("--arms", default=",".join(STUDY2.arms), help="comma-separated study arms to compare")
    args = ap.parse_args()
    configure_cpu(1)
    named = estimators(args.arms.split(","))
    print(f"gradient microscope: config {args.config} {' '.join(args.overrides)}; train arm {args.train_arm}, "
          f"reference {args.reference_arm} (on-policy, {args.ref_per_batch} x N batches), N = {args.batches}, "
          f"torch {torch.__version__}\n")
    results = {}
    for K, w, s in product([int(k) for k in args.ks.split(",")], args.warm_starts.split(","),
                           [int(x) for x in args.seeds.split(",")]):
        t0 = time.perf_counter()
        state, base = build_state(args.config, args.overrides, w, s, K, args.batches, args.train_arm,
                                  args.ref_per_batch)
        rows, header = measure(state, base, args.config, args.overrides, named, args.reference_arm)
        results[(w, s, K)] = rows
        print(f"### K = {K}, warm start {w}, seed {s}\n")
        print(f"stale ESS ratio {header['stale_ess_ratio']:.3f}; reward stale {header['stale_reward']:.3f}, "
              f"on-policy {header['on_policy_reward']:.3f}; reference split-half cos "
              f"{header['ref_split_half_cos']:+.3f}; {time.perf_counter() - t0:.0f} s "
              f"({state.train_s:.0f} s sampling and training)\n")
        print(table(rows) + "\n", flush=True)
    for K in sorted({k for _, _, k in results}):
        if len([s for s in results if s[2] == K]) > 1:
            print(summary(results, K) + "\n")


if __name__ == "__main__":
    main()
