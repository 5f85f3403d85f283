"""The named grids of `vcpo sweep --grid NAME`: arms, staleness values, seeds, pinned warm starts, the base
config and its overrides, with each grid's cost measured or estimated from measured per-step costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GRPO_ADV = "advantage.estimator=grpo"
NO_ESS_LR = "trainer.ess_lr.enabled=false"
ESS_LR = "trainer.ess_lr.enabled=true"

ARMS: dict[str, tuple[str, ...]] = {
    "grpo": ("objective.name=grpo", GRPO_ADV, NO_ESS_LR),
    "tis_seq": ("objective.name=tis", "objective.kwargs.level=sequence", "objective.kwargs.cap=8", GRPO_ADV, NO_ESS_LR),
    "icepop": ("objective.name=icepop", GRPO_ADV, NO_ESS_LR),
    "m2po": ("objective.name=m2po", GRPO_ADV, NO_ESS_LR),
    "vespo": ("objective.name=vespo", GRPO_ADV, NO_ESS_LR),
    "gspo": ("objective.name=gspo", GRPO_ADV, NO_ESS_LR),
    "vcpo": ("objective.name=vcpo", "advantage.estimator=opob", "advantage.grad_norm_method=fast", ESS_LR),
    "vcpo_ess_only": ("objective.name=vcpo", GRPO_ADV, ESS_LR),
    "vcpo_opob_only": ("objective.name=vcpo", "advantage.estimator=opob", "advantage.grad_norm_method=fast", NO_ESS_LR),
    # issue 24: OPOB without its self-inclusion (each row's baseline over the others), OPOB weighted by G alone,
    # and the latter with the logit proxy for G (no gradient norms at all).
    "vcpo_loo": ("objective.name=vcpo", "advantage.estimator=opob", "advantage.grad_norm_method=fast",
                 "advantage.opob_variant=leave_one_out", ESS_LR),
    "vcpo_gonly": ("objective.name=vcpo", "advantage.estimator=opob", "advantage.grad_norm_method=fast",
                   "advantage.opob_variant=grad_only", ESS_LR),
    "vcpo_gonly_proxy": ("objective.name=vcpo", "advantage.estimator=opob", "advantage.grad_norm_method=logit_proxy",
                         "advantage.opob_variant=grad_only", ESS_LR),
    # issue 46: VCPO's two controls (OPOB grad_only with the logit proxy for G, and the ESS learning rate) on top of
    # another objective's kernel: VESPO's (the best arm at 5.1M) and PPO-clip's (grpo).
    "vespo_vc": ("objective.name=vespo", "advantage.estimator=opob", "advantage.grad_norm_method=logit_proxy",
                 "advantage.opob_variant=grad_only", ESS_LR),
    "grpo_vc": ("objective.name=grpo", "advantage.estimator=opob", "advantage.grad_norm_method=logit_proxy",
                "advantage.opob_variant=grad_only", ESS_LR),
}
"""Each arm: the dotted overrides (as `vcpo train` takes them) that turn the base config into that method."""

AUTO = "async.max_staleness=auto"
# issue 26: adaptive staleness (async.max_staleness: auto) from k_min 4, +8 per 10-step window whose mean ESS ratio
# reaches 0.4, halved after one below it; the cell's k is the upper bound async.auto.k_max.
AUTO_SETTINGS = (AUTO, "async.auto.k_min=4", "async.auto.ess_target=0.4", "async.auto.window=10",
                 "async.auto.increase_step=8", "async.auto.decrease_factor=0.5")
ARMS |= {f"{arm}_auto": (*ARMS[arm], *AUTO_SETTINGS) for arm in ("grpo", "m2po", "vcpo")}


def is_auto(arm: str) -> bool:
    """Whether an arm adapts k (its cells' k is then the upper bound ``async.auto.k_max``)."""
    return AUTO in ARMS[arm]


@dataclass(frozen=True)
class WarmStartPin:
    """A committed warm-start model directory (relative to the repository root) and its content hash
    (:func:`vcpo.study.provenance.warm_start_hash`); a sweep refuses to run from a directory that differs."""

    path: str
    sha: str


@dataclass(frozen=True)
class Grid:
    """A named sweep: every (warm start x seed x arm x k) cell, run warm-start-major then seed-major."""

    arms: list[str]
    ks: list[int]
    seeds: list[int]
    overrides: list[str]
    base_config: str
    """Used when `vcpo sweep` gets no -c; relative to the repository root."""
    warm_starts: dict[str, WarmStartPin] = field(default_factory=dict)
    """Empty: each seed warm-starts from its own SFT (sft seed = RL seed), the cache as `vcpo train` does."""
    auto_ks: list[int] | None = None
    """The k of the adaptive arms' cells (their upper bound ``async.auto.k_max``); None = ``ks``."""


# study1 (issue 5, benchmarks/staleness/full/): the embedded default at lr 4e-4, chosen by the probes
# probe_lr3e-4 (nothing collapses in 200 steps), probe_lr5e-4_7e-4 (k=0 barely learns, k=64 grpo collapses)
# and probe_lr1e-3 (even k=0 degrades). 90 cells, 74 minutes with 2 workers on the 2-core VM.
STUDY1 = Grid(arms=["grpo", "tis_seq", "icepop", "m2po", "vespo", "gspo", "vcpo", "vcpo_ess_only", "vcpo_opob_only"],
              ks=[0, 4, 16, 64, 128], seeds=[0, 1], base_config="configs/quickstart.yaml",
              overrides=["trainer.lr=4e-4", "trainer.max_steps=300", "trainer.eval_every=25", "task.eval_size=200"])
# quick: 15 cells of 60 steps, about 5 minutes with 2 workers.
QUICK = Grid(arms=["grpo", "tis_seq", "vcpo", "vcpo_ess_only", "vcpo_opob_only"], ks=[0, 8, 32], seeds=[0],
             base_config="configs/quickstart.yaml",
             overrides=["trainer.max_steps=60", "trainer.eval_every=10", "task.eval_size=200"])
# study2 (issue 17): sums of three 1-digit numbers (configs/staleness_study.yaml), where synchronous RL at
# lr 3e-4 raises held-out accuracy clearly (0.422 -> 0.60, 0.294 -> 0.49-0.53 over 300 steps; the probes in
# benchmarks/staleness/probe_study2/). 7 arms x 4 k x 4 seeds x 2 pinned warm starts = 224 cells. Measured cost:
# 62-75 CPU-s per cell, so about 14,800 CPU-s: 2.1 hours with 2 workers on two idle cores (longer when the
# machine is shared), resumable, in parts with --warm-starts and --seeds.
# issue 24 adds vcpo_loo, vcpo_gonly and vcpo_gonly_proxy, run at a later commit whose `vcpo rerun` of committed
# cells reproduced them, so that old and new arms pair in one report. Issue 26's adaptive arms (grpo_auto,
# m2po_auto, vcpo_auto; run with --arms) have one cell per seed and warm start, k in [4, 128]: 24 cells.
STUDY2 = Grid(
    arms=["grpo", "tis_seq", "icepop", "m2po", "vespo", "vcpo", "vcpo_ess_only", "vcpo_loo", "vcpo_gonly",
          "vcpo_gonly_proxy"], ks=[0, 16, 64, 128],
    seeds=[0, 1, 2, 3], base_config="configs/staleness_study.yaml", overrides=[], auto_ks=[128],
    warm_starts={"w0": WarmStartPin("benchmarks/staleness/warm_starts/w0", "fa008a17bdfd45dd"),
                 "w1": WarmStartPin("benchmarks/staleness/warm_starts/w1", "7d3243aed6b861fe")},
)
# study2_mismatch (issue 24): study2's setup with a simulated sampler/learner mismatch (rollout.study_mismatch_std=0.6:
# a synchronous batch sits at ESS ratio about exp(-0.36) = 0.70, the VCPO paper's synchronous range), where the
# reward-independent spread of W is what the plug-in's W^2 weighting was derived for: does grad_only still win there?
# 4 arms x 2 k x 4 seeds x 2 warm starts = 64 cells at study2's cost per cell.
STUDY2_MISMATCH = Grid(arms=["grpo", "vcpo", "vcpo_gonly", "vcpo_ess_only"], ks=[0, 16], seeds=[0, 1, 2, 3],
                       base_config="configs/staleness_study.yaml", overrides=["rollout.study_mismatch_std=0.6"],
                       warm_starts=STUDY2.warm_starts)
# study3 (issue 37): the tool task of configs/tools.yaml (multi-turn SimpleTIR-format products, every tool call a
# real sandbox run), lagged, at the shipped learning rate 3e-4 for every arm (a later probe on k = 0 prefers 1e-4,
# within noise; add trainer.lr=1e-4 to run the grid there: benchmarks/staleness/study3_lr1e-4/), 40 steps
# (synchronous GRPO plateaus by step 10-20: benchmarks/staleness/probe_study3/). Pinned warm starts: w0 (SFT seed 0,
# 300 steps, held-out 0.660) and w4 (SFT seed 1, 600 steps, 0.755; synchronous GRPO 0.755 -> 0.825 in 40 steps).
# 300-step SFT is unreliable across seeds (0.03-0.66), synchronous GRPO collapses from seed 1's 300-step model (0.380)
# and falls from seed 2's 600-step one (w3, 0.59 -> 0.47); benchmarks/staleness/warm_starts_tools/README.md.
# 5 arms x 4 k x 3 seeds = 60 cells, about 2-7 minutes each with 2 workers. What was cut from issue 37's grid, and
# why: benchmarks/staleness/study3/README.md.
STUDY3 = Grid(
    arms=["grpo", "vcpo", "vcpo_gonly", "vespo", "vcpo_gonly_proxy"], ks=[0, 4, 16, 64], seeds=[0, 1, 2],
    base_config="configs/tools.yaml",
    overrides=["trainer.max_steps=40", "trainer.eval_every=10", "task.eval_size=200", "trainer.checkpoint_every=0"],
    warm_starts={"w0": WarmStartPin("benchmarks/staleness/warm_starts_tools/w0", "2f2ffd81b9078568"),
                 "w4": WarmStartPin("benchmarks/staleness/warm_starts_tools/w4", "64c05b3a2c847bfe")},
)
# study4 (issue 37, item 2): study2's task, config and learning rate at a model 11.7x larger (6 layers, d 256,
# 8 heads, MLP 768: 5.1M parameters against 0.44M), built by `vcpo sft -c configs/staleness_study.yaml sft.seed=N
# sft.architecture.hidden_size=256 sft.architecture.num_layers=6 sft.architecture.num_heads=8
# sft.architecture.intermediate_size=768 --save DIR`. lr 3e-4 chosen on k = 0 (synchronous GRPO from w0: 0.264 ->
# 0.360 in 300 steps; at 6e-4 it falls to 0.16-0.24): benchmarks/staleness/study4/README.md. 4 arms x 3 k x 2 seeds
# x 2 warm starts = 48 cells of 5.5-7 minutes with 2 workers on the idle 2-core VM (2.2-2.8 hours); all 48 ran.
STUDY4 = Grid(arms=["grpo", "vcpo", "vcpo_gonly", "vespo"], ks=[0, 16, 64], seeds=[0, 1],
              base_config="configs/staleness_study.yaml", overrides=[],
              warm_starts={"w0": WarmStartPin("benchmarks/staleness/warm_starts_large/w0", "1184fdc84235ba47"),
                           "w1": WarmStartPin("benchmarks/staleness/warm_starts_large/w1", "12fd071420e7ec92")})
# heldout (issue 46, item 4): the setting the recommendation is tested on, written down before it ran
# (benchmarks/staleness/heldout/PREDICTION.md): configs/heldout_decimals.yaml, reasoning-gym decimal_chain_sum with
# two 1-digit terms of one decimal place at the 0.44M model, 300 steps. Pinned warm starts: 700 SFT steps of seeds 0
# and 1 (held-out 0.620 and 0.668; benchmarks/staleness/warm_starts_decimals/). 4 arms x 3 k x 2 seeds x 2 warm
# starts = 48 cells of 1.5-2 minutes with 2 workers on the 2-core VM, plus the k = 0 rate probe (trainer.lr=1e-4).
HELDOUT = Grid(arms=["grpo", "vespo", "vcpo_gonly", "vespo_vc"], ks=[0, 16, 64], seeds=[0, 1],
               base_config="configs/heldout_decimals.yaml", overrides=[],
               warm_starts={"w0": WarmStartPin("benchmarks/staleness/warm_starts_decimals/w0", "bcf25d73ac7a1c12"),
                            "w1": WarmStartPin("benchmarks/staleness/warm_starts_decimals/w1", "aee5ba6ad882355d")})
GRIDS = {"study2": STUDY2, "study3": STUDY3, "study1": STUDY1, "quick": QUICK, "study2_mismatch": STUDY2_MISMATCH,
         "study4": STUDY4, "heldout": HELDOUT}
