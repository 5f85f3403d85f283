"""``trainer`` (with ``trainer.ess_lr`` and ``trainer.health``): the optimizer, the loop's schedule, the alarms."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vcpo.config.base import _Strict
from vcpo.config.recipe import DEFAULT_RECIPE, RECIPES


class ESSLRConfig(_Strict):
    """The ESS-scaled learning rate (VCPO §8.2): each step's lr is trainer.lr times a scale of the ESS ratio rho."""

    enabled: bool = RECIPES[DEFAULT_RECIPE]["trainer.ess_lr.enabled"]
    """Scale the learning rate by the ESS ratio; false = trainer.lr at every step."""
    rule: Literal["sqrt", "linear"] = "sqrt"
    """The scale: ``sqrt`` sqrt(min(1, rho / reference)), ``linear`` min(1, rho / reference)."""
    reference: float = Field(1.0, gt=0)
    """The ESS ratio at and above which the full trainer.lr applies (the paper uses 0.55 for tool use)."""


AlarmRule = Literal["nonfinite", "dead_policy", "uniform_policy", "no_signal", "reward_collapse", "ess",
                    "accuracy_fall"]


class HealthConfig(_Strict):
    """The live health alarms (docs/trainer.md, health alarms): each rule's thresholds; defaults raise none on the
    healthy runs measured (benchmarks/notes/issue26_health.md)."""

    disabled: list[AlarmRule] = Field(default_factory=list)
    """Rules that never fire (their smoothed quantities are still logged)."""
    dead_entropy: float = Field(1e-3, ge=0)
    """dead_policy: the mean negative log-prob of the sampled tokens (an estimate of the per-token entropy) below
    this ..."""
    dead_grad_norm: float = Field(1e-4, ge=0)
    """... and the gradient norm (finite, before clipping) below this ..."""
    dead_steps: int = Field(3, ge=1)
    """... for this many steps in a row."""
    uniform_frac: float = Field(0.9, gt=0, le=1)
    """uniform_policy: the sampled tokens' mean negative log-prob at or above this fraction of ln(vocabulary size)
    (a uniform policy's entropy) ..."""
    entropy_rise: float = Field(2.0, gt=0)
    """... or above its first step's level by more than this many nats per token (the largest rise in the staleness
    study's 437 runs, collapsed ones included, was 0.25; a barely warm-started tiny model at lr 1e-3, whose few
    sampled tokens make a noisy estimate, rose by 1.0 in 8 steps) ..."""
    uniform_steps: int = Field(2, ge=1)
    """... for this many steps in a row."""
    no_signal_steps: int = Field(3, ge=1)
    """no_signal: every group's rewards equal (``reward/zero_var_group_frac`` = 1) and the gradient norm below
    ``dead_grad_norm``, this many steps in a row: nothing is learned."""
    max_reward: float = 1.0
    """The reward of a fully correct response: a step whose every reward equals it is saturated (every group solved),
    which no_signal and dead_policy do not count; after no_signal_steps of them in a row a notice says so, and
    trainer.on_alarm does not act on it."""
    reward_drop: float = Field(0.5, gt=0, lt=1)
    """reward_collapse: the training reward's ``reward_smooth``-step mean below (1 - this) x its best such mean."""
    reward_smooth: int = Field(25, ge=1)
    """The window (steps) of the training-reward mean."""
    reward_floor: float = Field(0.05, ge=0)
    """reward_collapse judges a fall only once the best smoothed reward reaches this (a near-zero reward's noise
    is no collapse)."""
    reward_fall_window: int = Field(3, ge=1)
    """reward_collapse also fires, from the first step on, when the mean training reward of the last this many steps
    is below (1 - ``reward_drop``) x the first step's reward (once that reaches ``reward_floor``) and below it by
    more than two standard errors (each group one sample), up to step max(``warmup``, ``reward_smooth``): a run that
    dies in its first steps never builds a smoothed best."""
    ess_below: float = Field(0.2, gt=0, le=1)
    """ess: the ESS ratio's ``ess_smooth``-step mean below this ..."""
    ess_smooth: int = Field(10, ge=1)
    """The window (steps) of the ESS-ratio mean."""
    ess_grad_below: float | None = Field(1.2, gt=0)
    """... while the gradient norm's ``grad_smooth``-step mean (before clipping) is below this; None = the ESS level
    alone. 1.2 suits the embedded default model (tuned on study2); scale it to another model's gradient norms."""
    grad_smooth: int = Field(25, ge=1)
    """The window (finite steps) of the gradient-norm mean."""
    warmup: int = Field(20, ge=0)
    """reward_collapse and ess fire from this step on (the first steps' means are noisy, and a lagged run's lag
    still ramps up)."""
    accuracy_fall: float = Field(0.4, gt=0, lt=1)
    """accuracy_fall: held-out accuracy below this x its best so far (the evaluation before RL included) ..."""
    accuracy_evals: int = Field(2, ge=1)
    """... at this many evaluations in a row (one at the run's final evaluation)."""


class TrainerConfig(_Strict):
    """The RL optimisation loop: steps, optimizer, evaluations, checkpoints."""

    max_steps: int = Field(200, gt=0)
    """Optimizer steps of the run (a resumed run continues up to it)."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate (before the ESS scale)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decay rates (beta1, beta2)."""
    grad_clip: float = Field(1.0, gt=0)
    """Largest L2 norm of the whole gradient; larger ones are scaled down to it."""
    ess_lr: ESSLRConfig = Field(default_factory=ESSLRConfig)
    eval_every: int = Field(20, ge=0)
    """Steps between held-out evaluations (0 = only at the start and the end)."""
    eval_samples: int = Field(0, ge=0)
    """Samples per held-out problem at each evaluation, logged as ``eval/mean@N`` and ``eval/pass@N`` beside the
    greedy ``eval/accuracy``; 0 = greedy only."""
    eval_temperature: float = Field(0.8, gt=0)
    """The temperature of those samples (0.8 and top-p 0.7: the settings reasoning papers report at)."""
    eval_top_p: float = Field(0.7, gt=0, le=1)
    """The nucleus mass of those samples."""
    checkpoint_every: int = Field(50, ge=0)
    """Steps between checkpoints (0 = only at the end); a run always checkpoints its last step."""
    keep_checkpoints: int | None = Field(2, ge=1)
    """Checkpoints kept, the newest; older ones are deleted as each new one lands (null keeps every one, e.g. to
    evaluate them after the run). trainer.on_alarm stop and rollback keep at least health.dead_steps + 2."""
    max_skipped_steps: int = Field(3, ge=1)
    """The run stops (with a checkpoint) after this many consecutive steps skipped as non-finite
    (gradient, loss, ESS or a sampled log-prob)."""
    max_time_s: float | None = Field(None, gt=0)
    """A wall-clock budget per invocation: the run ends (evaluated and checkpointed as at max_steps)
    after the first step that finishes past it. None = max_steps alone decides."""
    micro_batch_tokens: int | None = Field(None, gt=0)
    """Padded tokens per forward/backward (rows x longest row); None = the whole batch in one pass. The update
    equals the full-batch one for every objective and loss_agg (docs/trainer.md, micro-batches)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (Hugging Face's
    activation checkpointing); the fast OPOB capture pass keeps its activations regardless."""
    num_learners: int = Field(1, gt=0)
    """Data-parallel learner ranks in one torch.distributed group: local processes, or Ray actors with
    async.backend=ray."""
    sharding: Literal["none", "fsdp"] = "none"
    """``none``: every learner rank holds the whole model; ``fsdp``: FSDP2 shards parameters, gradients and optimizer
    state over the trainer.num_learners ranks (docs/scaling.md)."""
    on_alarm: Literal["warn", "stop", "rollback"] = "warn"
    """What a health alarm does: ``warn`` (a line, the run goes on), ``stop`` (exit 3 with a checkpoint of the last
    step no rule flagged), ``rollback`` (back to a checkpoint from before the alarm, learning rate halved; after
    trainer.max_rollbacks, stop). stop and rollback checkpoint every step that raised no alarm."""
    max_rollbacks: int = Field(3, ge=0)
    """Rollbacks a run may make in all (across resumes); the alarm after the last one stops the run (exit 3)."""
    health: HealthConfig = Field(default_factory=HealthConfig)


