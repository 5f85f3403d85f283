"""The logit proxy of OPOB's G against the exact G, and its learner-step cost, side by side in one run (issue 24).

On the gradient microscope's states (benchmarks/gradient_quality.py: a pinned warm start, K lagged steps of the
vcpo arm, then stale batches sampled K versions back), for each stale batch:

- rank agreement: Spearman's rho between the proxy ``sum_t 1 - 2 pi(y_t) + sum_v pi_v^2`` and the exact
  ``G_i = ||grad_theta sum_t log pi||^2`` (one backward per row) over the rows whose OPOB advantage uses G (the
  mixed-reward groups), and the mean of the within-group rho (OPOB's weights are ratios within a group);
- step cost: ``Learner.step`` of grpo, vcpo_ess_only, vcpo (fast ghost norms) and vcpo with the logit proxy,
  each arm on its own copy of theta_K, round-robin over the stale batches so machine drift hits every arm alike;
  the median step time, its ratio to grpo's, and the median of the per-round ratios ("paired x").

    python benchmarks/logit_proxy.py                        # w0, seed 0, K = 16, 8 batches x 3 rounds
    python benchmarks/logit_proxy.py --warm-starts w0,w1 --ks 16,64 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from itertools import product

import torch
from gradient_quality import ARMS, ROOT, build_state

from vcpo.config import load_config
from vcpo.runtime import configure_cpu
from vcpo.train.learner import Learner
from vcpo.variance import logit_proxy_grad_sq_norms, opob_rows_needing_grad_norms, token_logprobs
from vcpo.variance import trajectory_grad_sq_norms as exact_norms

STEP_ARMS = {
    "grpo": list(ARMS["grpo"]),
    "vcpo_ess_only": list(ARMS["vcpo_ess_only"]),
    "vcpo (fast G)": list(ARMS["vcpo"]),
    "vcpo (logit proxy)": [*ARMS["vcpo"], "advantage.grad_norm_method=logit_proxy"],
}


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman's rho (Pearson's r of the ranks; the values here are continuous, so ties do not arise)."""
    rx, ry = (v.argsort().argsort().double() for v in (x, y))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float(rx @ ry / (rx.norm() * ry.norm()))


def rank_agreement(model, batch, temperature: float) -> tuple[float, float, int]:
    """(rho over the batch's mixed-group rows, mean within-group rho, number of those rows)."""
    needed = opob_rows_needing_grad_norms(batch.rewards_B, batch.group_ids_B)
    rows = batch.rows(needed.nonzero(as_tuple=True)[0])
    with torch.no_grad():
        lp, _, collision = token_logprobs(model, rows.input_ids_BS, rows.attention_mask_BS, temperature,
                                          positions=rows.response_mask_BS, return_collision=True)
    proxy = logit_proxy_grad_sq_norms(lp, collision, rows.response_mask_BS, temperature)
    exact = exact_norms(model, rows.input_ids_BS, rows.response_mask_BS, rows.attention_mask_BS, method="exact")
    within = [spearman(proxy[rows.group_ids_B == g], exact[rows.group_ids_B == g])
              for g in rows.group_ids_B.unique() if int((rows.group_ids_B == g).sum()) > 2]
    return spearman(proxy, exact), sum(within) / max(len(within), 1), int(needed.sum())


def step_times(state, config_path: str, base_overrides: list[str], rounds: int) -> dict[str, dict[str, float]]:
    learners = {arm: Learner(copy.deepcopy(state.model), load_config(config_path, [*base_overrides, *o]))
                for arm, o in STEP_ARMS.items()}
    times: dict[str, list[float]] = {arm: [] for arm in learners}
    for _ in range(rounds):
        for batch in state.stale:
            for arm, learner in learners.items():
                t0 = time.perf_counter()
                learner.step(batch)
                times[arm].append(time.perf_counter() - t0)
    return {arm: {"median_s": statistics.median(t),
                  "paired_x": statistics.median(a / g for a, g in zip(t, times["grpo"], strict=True))}
            for arm, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=str(ROOT / "configs/staleness_study.yaml"))
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--ks", default="16")
    ap.add_argument("--warm-starts", default="w0")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the batches for the step timings")
    args = ap.parse_args()
    configure_cpu(1)
    print(f"logit proxy vs exact G: config {args.config}, torch {torch.__version__}, one thread\n")
    print("| state | rows/batch | Spearman rho per batch: median [min, max] | within-group rho (mean) |"
          " step s: grpo | vcpo_ess_only | vcpo fast G | vcpo proxy | x grpo (paired): ess_only | fast | proxy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for K, w, s in product([int(k) for k in args.ks.split(",")], args.warm_starts.split(","),
                           [int(x) for x in args.seeds.split(",")]):
        state, base = build_state(args.config, args.overrides, w, s, K, args.batches, "vcpo", ref_per_batch=0)
        agreement = [rank_agreement(state.model, b, base.rollout.temperature) for b in state.stale]
        rho = [a[0] for a in agreement]
        pinned = [*args.overrides, f"model.path={base.model.path}", f"seed={s}"]
        t = step_times(state, args.config, pinned, args.rounds)
        m = [t[a]["median_s"] for a in STEP_ARMS]
        x = [t[a]["paired_x"] for a in list(STEP_ARMS)[1:]]
        print(f"| {w} s{s} K={K} | {statistics.mean(a[2] for a in agreement):.0f} | {statistics.median(rho):+.3f} "
              f"[{min(rho):+.3f}, {max(rho):+.3f}] | {statistics.mean(a[1] for a in agreement):+.3f} | "
              + " | ".join(f"{v:.4f}" for v in m) + " | " + " | ".join(f"{v:.3f}" for v in x) + " |", flush=True)


if __name__ == "__main__":
    main()
