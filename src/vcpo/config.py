"""Run configuration: pydantic models, YAML loading, dotted command-line overrides.

``load_config(path, ["trainer.lr=1e-4", ...])`` returns a validated ``Config``; any unknown key or
bad value raises ``ConfigError`` with one line naming it. The resolved config is saved with the run.
Torch-free: every check here (objective hyperparameters included) runs before any heavy import.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from vcpo.errors import DiskError, UserError
from vcpo.objective_specs import (
    BUILTIN_OBJECTIVES,
    SUM_NORM,
    HyperparameterError,
    check_hyperparameters,
    objective_names,
    spec_of,
)
from vcpo.plugins import PluginError, is_import_path, load_function

log = logging.getLogger(__name__)


class ConfigError(UserError, ValueError):
    """A user-fixable problem with the configuration; its message is one line naming the culprit."""


class _Strict(BaseModel):
    # use_attribute_docstrings: the string under each field is its description (`vcpo config show`, docs/config.md).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class LoraConfig(_Strict):
    """LoRA (low-rank adapters, through peft): train and sync only the adapters, the base weights stay fixed."""

    rank: int = Field(0, ge=0)
    """The adapters' rank r; 0 = off (full fine-tuning). Needs peft (``pip install 'vcpo[lora]'``)."""
    alpha: float = Field(16.0, gt=0)
    """The adapters' scale numerator: each adapted layer computes ``W x + (alpha / rank) B A x``."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input, in the learner's gradient passes only (never while sampling); above 0 the
    log-probs the objective, ESS and the mismatch metric see are noisy: 0 is recommended for RL."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Which modules get adapters: ``all-linear`` (every linear layer but the LM head) or a list of module names
    (e.g. ``[q_proj, v_proj]``), as peft's ``target_modules``."""


class ModelConfig(_Strict):
    """The policy model: which weights, in which dtype, on which device."""

    path: str | None = None
    """A local Hugging Face model directory; None = the embedded default, warm-started by SFT."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """The weights' compute dtype (float64 for numerical tests). With bfloat16 the optimizer keeps float32 master
    weights; log-probs, importance weights, ESS, OPOB and objectives are float32 whatever the weights' dtype."""
    device: str = "auto"
    """``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    lm_head_fp32: bool = False
    """Compute the LM head's logits in float32 (engine and learner alike) from half-precision hidden states."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters (docs/lora.md); ``rank`` 0 = full fine-tuning."""

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"must be auto, cpu, cuda or cuda:N, got {v!r}")
        return v


class TaskConfig(_Strict):
    """What the policy learns to solve: the problems, their prompts, their rewards."""

    name: str = "chain_sum"
    """A reasoning-gym dataset name, ``jsonl`` / ``parquet`` for a local dataset file (docs/datasets.md),
    ``tools:<dataset>`` for its multi-turn tool task (docs/tools.md), ``agent:<module>:<function>`` for an agent
    written for the OpenAI API (docs/agents.md), or ``module.sub:Name``: your own task or multi-turn environment, a
    class or factory called with ``kwargs`` (docs/extending.md)."""
    kwargs: dict[str, Any] = Field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    )
    """The task's own settings (the default is chain_sum's; another task named without kwargs gets none): the
    reasoning-gym dataset config (e.g. digit counts); for ``jsonl`` / ``parquet``: ``path`` (or ``train_path`` and
    ``eval_path``), ``prompt_field``, ``answer_field``, ``answer_format``, ``eval_fraction``; for ``agent:...``:
    ``problems`` (the task its problems come from), ``problem_kwargs`` (that task's kwargs), ``agent_timeout_s``,
    ``agent_retries``, ``rows`` and ``served_model`` (docs/agents.md)."""
    prompt_format: Literal["raw", "chat"] = "raw"
    """``raw``: the prompt text as is; ``chat``: the tokenizer's chat template (an error when it has none)."""
    system_prompt: str | None = None
    """Chat format: a system message before the problem; None = none."""
    instruction: str | None = None
    """Appended to the problem on its own line; None = the format's default ("Please reason step by step, and put
    your final answer within \\boxed{}." in chat format, nothing in raw format); "" = none."""
    reward: str = "native"
    """reasoning-gym tasks: ``native`` = the dataset's own scorer, ``math`` = math-verify on the reference answer,
    ``auto`` = math when every one of 64 sampled answers is a number; dataset files are scored by math. Either
    kind of task: ``module.sub:function``, your own ``function(completion, answer) -> float`` in [0, 1], run in the
    sandboxed scoring pool (docs/extending.md)."""
    eval_size: int = Field(500, gt=0)
    """Held-out problems for ``eval/accuracy`` (a separate seed from the training stream)."""
    reward_timeout_s: float = Field(5.0, gt=0, le=3600)
    """Wall-clock limit per scored completion; past it the sandboxed scorer is killed and the reward is 0."""
    reward_workers: int = Field(1, gt=0, le=64)
    """Sandboxed scoring processes per process that scores (the trainer; each async rollout worker). Each
    costs a second or more of CPU to import its scorer's libraries; more help when scoring is slow."""

    @model_validator(mode="before")
    @classmethod
    def _kwargs_of_the_default_task(cls, data: Any) -> Any:
        """The default kwargs are chain_sum's: another task named without kwargs gets none."""
        if isinstance(data, dict) and "kwargs" not in data and data.get("name", "chain_sum") != "chain_sum":
            return {**data, "kwargs": {}}
        return data

    @field_validator("reward")
    @classmethod
    def _reward(cls, v: str) -> str:
        if v in ("native", "math", "auto"):
            return v
        if not is_import_path(v):
            raise ValueError("must be native, math, auto, or an import path module.sub:function")
        from vcpo.rewards.scorers import REWARD_ARGUMENTS

        try:
            load_function(v, REWARD_ARGUMENTS)
        except PluginError as e:
            raise ValueError(e.reason) from None
        return v

    @model_validator(mode="after")
    def _dataset_files(self) -> TaskConfig:
        from vcpo.tasks.records import DATASET_TASKS, check_dataset_kwargs
        from vcpo.tasks.user_task import check_user_task, is_user_task

        if self.name.startswith("agent:"):
            from vcpo.agents.task import agent_settings, problem_task_config

            agent_settings(self.name, self.kwargs)
            problem_task_config(self)  # the problem task's own checks
        elif self.name in DATASET_TASKS:
            check_dataset_kwargs(self.name, self.kwargs)
        elif is_user_task(self.name):
            check_user_task(self.name, self.kwargs)
        if is_import_path(self.reward) and (is_user_task(self.name) or self.name.startswith("tools:")):
            raise ValueError(f"task.reward={self.reward!r} scores reasoning-gym and dataset tasks; task {self.name!r} "
                             "scores its own completions")
        return self


class ArchitectureConfig(_Strict):
    """The shape of the embedded default model (a Llama with tied embeddings and a character tokenizer). The
    default, about 0.44M parameters, trains on two CPU cores in minutes; `hidden_size: 256, num_layers: 6,
    num_heads: 8, intermediate_size: 768` is about 5M (the larger-model staleness study, docs/study.md)."""

    hidden_size: int = Field(128, gt=0)
    """The width of the residual stream (and of the tied embeddings)."""
    num_layers: int = Field(2, gt=0)
    """Transformer blocks."""
    num_heads: int = Field(4, gt=0)
    """Attention heads (as many key-value heads); must divide hidden_size."""
    intermediate_size: int = Field(384, gt=0)
    """The MLP's inner width."""

    @model_validator(mode="after")
    def _heads_divide(self) -> ArchitectureConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"sft.architecture.num_heads ({self.num_heads}) must divide "
                             f"sft.architecture.hidden_size ({self.hidden_size})")
        return self


class SFTConfig(_Strict):
    """The supervised warm start of the embedded default model (model.path: null); unused with a model.path."""

    steps: int = Field(400, ge=0)
    """Optimizer steps of teacher-forced fine-tuning on solved training problems."""
    batch_size: int = Field(64, gt=0)
    """Problems per SFT step."""
    lr: float = Field(2e-3, gt=0)
    """AdamW learning rate, warmed up linearly over the first 5% of steps, then constant."""
    seed: int | None = None
    """The warm start's seed (model initialisation, SFT data, its own accuracy check); None = the run's ``seed``.
    Set it to cross warm starts with RL seeds (the staleness study's 2 warm starts x 4 seeds)."""
    cache_dir: str = ".cache/vcpo"
    """Where the warm-started default model is cached, keyed by its settings."""
    architecture: ArchitectureConfig = Field(default_factory=ArchitectureConfig)
    """The default model's shape (part of the cache key)."""


class LaunchConfig(_Strict):
    """Inference servers that ``vcpo train`` starts and stops itself (docs/server.md): ``rollout.server.kind``
    (``vllm`` or ``vcpo``) on the run's model, bound to 127.0.0.1 on free ports, with the learner's dtype."""

    num_servers: int = Field(1, ge=1, le=16)
    python: str | None = None
    """The Python interpreter of the environment that has the server (e.g. ``.venv-vllm/bin/python``); None = this
    one."""
    extra_args: list[str] = Field(default_factory=list)
    """Appended to each server's start command, e.g. ``[--enforce-eager, --kv-cache-memory-bytes, 1G]``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables of each server (e.g. ``OMP_NUM_THREADS``)."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long each server may take to answer ``/health``; then the run stops and prints its log's tail."""


class ServerConfig(_Strict):
    """Inference servers for ``rollout.engine: server`` (docs/server.md)."""

    urls: list[str] = Field(default_factory=list)
    """Base URLs, e.g. ``http://127.0.0.1:8000``; prompts are spread over the servers that answer."""
    launch: LaunchConfig | None = None
    """Start the servers with the run instead (``urls`` then stays empty); None = use ``urls``."""
    kind: Literal["vcpo", "vllm", "sglang"] = "vcpo"
    """What the servers are: ``vcpo serve``, vLLM or SGLang (each has its own weight-update call)."""
    model: str | None = None
    """The served model name sent with each request (vLLM's ``model``); None = none sent."""
    weights_dir: str | None = None
    """Where each published version is written (the servers read the same path); None = {run_dir}/server_weights."""
    keep_weights: int = Field(2, gt=0)
    """Version directories kept in weights_dir (older ones are removed)."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Limit on opening a connection to a server."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Per generation call (a call waits while its server is paused for an update)."""
    control_timeout_s: float = Field(120.0, gt=0)
    """Per pause, update or resume call."""
    retries: int = Field(2, ge=0, le=10)
    """Retries of a call that failed in transport or with a 5xx; then the server is skipped from then on."""
    retry_backoff_s: float = Field(0.5, ge=0)
    """Wait before the first retry; doubled before each next one."""
    weight_check_tol: float | None = Field(1e-3, gt=0)
    """After each update every server scores a fixed 16-token sequence; a log-prob further than this from the
    learner's stops the run (vLLM only; raise it for bfloat16 weights). None = no check."""

    @field_validator("urls")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", url):
                raise ValueError(f"{url!r} is not a base URL like http://127.0.0.1:8000")
        return v

    @model_validator(mode="after")
    def _one_source_of_servers(self) -> ServerConfig:
        if self.launch is not None and self.urls:
            raise ValueError("rollout.server.launch starts the servers itself: leave rollout.server.urls empty")
        if self.launch is not None and self.kind == "sglang":
            raise ValueError("rollout.server.launch starts vllm or vcpo servers, not sglang (start it yourself and "
                             "name it in rollout.server.urls)")
        return self


class RolloutConfig(_Strict):
    """Sampling the training trajectories."""

    prompts_per_step: int = Field(16, gt=0)
    """Problems (GRPO groups) sampled per optimizer step."""
    group_size: int = Field(8, gt=0)
    """Completions sampled per problem; advantages compare the completions of one group."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the training completions."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass of the training completions (1 = the full distribution)."""
    max_new_tokens: int = Field(8, gt=0)
    """Longest completion in tokens (per model turn for a multi-turn tool task); also used by every evaluation."""
    engine: Literal["hf", "server"] = "hf"
    """``hf``: in-process Hugging Face generation; ``server``: the inference servers of ``rollout.server``."""
    filter: Literal["none", "zero_variance"] = "none"
    """Dynamic sampling (DAPO): ``zero_variance`` drops each finished group whose rewards are all equal (every
    advantage 0: no signal), frees its staleness capacity, and generates more until a step has
    ``prompts_per_step`` informative groups (docs/trainer.md, dynamic sampling); ``none`` trains on every group."""
    filter_max_factor: float = Field(4.0, ge=1)
    """With ``filter: zero_variance``, the most groups a step generates per group it trains (a cap of
    floor(this x prompts_per_step) groups); a step that reaches it trains on what it has, topped up with dropped
    groups (``filter/cap_hit`` = 1)."""
    filter_pass_rate: tuple[float, float] = (0.0, 1.0)
    """With ``filter: zero_variance``, the band [low, high] of a group's pass rate (its mean reward: the fraction
    correct for 0/1 rewards) that a step keeps, on top of the zero-variance rule; groups outside it are dropped and
    refilled like groups without signal. The default [0, 1] keeps every informative group; online difficulty
    filtering (PRIME) uses [0.2, 0.8], which for groups of 8 with 0/1 rewards also drops prompts solved once or
    seven times."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    study_mismatch_std: float = Field(0.0, ge=0)
    """STUDY ONLY, off (0) by default: simulate a sampler/learner kernel mismatch by adding reward-independent noise
    eps_i ~ N(0, s^2) to each sequence's behaviour log-prob (spread over its tokens), so W_i gets a log-normal
    factor exp(-eps_i) and a synchronous run sits at ESS ratio about exp(-s^2) (0.6-0.75 for s 0.54-0.71, the VCPO
    paper's synchronous range). Applied where the learner reads the batch (vcpo.train.mismatch); the samples
    themselves are unchanged. Never for real training."""


class ObjectiveConfig(_Strict):
    """The policy-gradient loss (docs/objectives.md)."""

    name: str = "vcpo"
    """A registered objective (reinforce, ppo_clip (grpo), gspo, gspo_token, gmpo, sapo, cispo, tis, mis, icepop,
    m2po, vespo, bapo, topr, tb, vcpo), or ``module.sub:name``: your own objective function by import path
    (docs/extending.md)."""
    loss_agg: str | None = None
    """How the per-token losses are averaged: token-mean, seq-mean-token-mean, seq-mean-token-sum or
    seq-mean-token-sum-norm (docs/objectives.md); None = the objective's own default."""
    max_len: int | None = Field(None, gt=0)
    """The constant length of ``loss_agg: seq-mean-token-sum-norm`` (Dr. GRPO), required by it, used by no other."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """The objective's own hyperparameters, typed and range-checked (strings such as "1e3" become numbers)."""

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v in objective_names():
            return v
        if not is_import_path(v):
            raise ValueError(f"unknown objective {v!r}; valid: {', '.join(objective_names())}, or an import path "
                             "module.sub:name")
        from vcpo.objectives.registry import resolve  # imports torch: only for a user's own objective

        try:
            resolve(v)
        except PluginError as e:
            raise ValueError(e.reason) from None
        return v


class AdvantageConfig(_Strict):
    """How each completion's advantage is computed from the rewards of its group (docs/variance.md)."""

    estimator: Literal["grpo", "dr_grpo", "rloo", "opo", "opob"] = "opob"
    """``grpo`` (R - mean) / std; ``dr_grpo`` R - mean; ``rloo`` leave-one-out mean; ``opo`` length-weighted
    baseline; ``opob`` VCPO's baseline weighted by importance weight squared times gradient norm squared."""
    opob_weighting: Literal["paper", "authors_code"] = "paper"
    """OPOB's weights: ``paper`` W^2 G; ``authors_code`` W^2 min(W, cap)^2 G, as the authors' released code."""
    opob_variant: Literal["plugin", "leave_one_out", "grad_only"] = "plugin"
    """OPOB's baseline (docs/variance.md): ``plugin``, the paper's group baseline b_g; ``leave_one_out``, each row's
    baseline over the other rows of its group; ``grad_only``, weights G without W^2. Any variant, either weighting."""
    grad_norm_method: Literal["exact", "fast", "logit_proxy"] = "fast"
    """How OPOB gets per-trajectory gradient norms: "fast" (one batched backward, ghost norms), "exact" (one
    backward per row, the reference) or "logit_proxy" (the squared norm of the gradient with respect to the logits
    only, from the learner's own forward: no extra backward; a proxy that ranks rows, not G itself)."""


class ESSLRConfig(_Strict):
    """The ESS-scaled learning rate (VCPO §8.2): each step's lr is trainer.lr times a scale of the ESS ratio rho."""

    enabled: bool = True
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


class ReplayConfig(_Strict):
    """TBA's replay buffer (vcpo/orchestration/replay.py), in units of whole GRPO groups."""

    enabled: bool = False
    """Keep groups after training on them and mix replayed ones into later steps (TBA); false = no buffer."""
    capacity: int = Field(64, gt=0)
    """Groups kept at most; beyond it the oldest (by policy version) are evicted."""
    recent_fraction: float = Field(0.5, ge=0, le=1)
    """Share of each step's groups drawn from the groups generated for this step (TBA's m)."""
    priority_inv_temp: float = Field(1.0, ge=0)
    """Older groups are drawn with probability proportional to exp(this * group mean reward); 0 = uniform."""
    max_uses: int = Field(4, gt=0)
    """How many times a group may be trained on in all (1 = never replayed)."""
    groups_per_step: int | None = Field(None, gt=0)
    """Groups trained on per step; None = rollout.prompts_per_step (the groups generated per step)."""
    generation_lag: int | None = Field(None, ge=0)
    """The staleness bound the rollout source itself runs with (lagged: its exact lag; async: its
    admission bound; sync: 0 whatever this says); None = async.max_staleness (with auto: the k in force).
    Replayed groups then age up to async.max_staleness, the bound on every token trained on."""


class AutoStalenessConfig(_Strict):
    """The ESS-driven bound of ``async.max_staleness: auto`` (docs/trainer.md, adaptive staleness); ignored with a
    fixed k. Every ``window`` steps the mean ESS ratio of those steps is compared with ``ess_target``: below it k is
    multiplied by ``decrease_factor`` (rounded down), at or above it k grows by ``increase_step``, within
    [k_min, k_max]."""

    k_min: int = Field(1, ge=0)
    """The lowest bound the controller may set (0 = synchronous batches)."""
    k_max: int = Field(64, ge=1)
    """The highest bound the controller may set; above k_min."""
    k_start: int | None = Field(None, ge=0)
    """The bound of the first steps, within [k_min, k_max]; None = k_min (start safe, earn staleness)."""
    ess_target: float = Field(0.4, gt=0, lt=1)
    """The ESS ratio a window's mean must reach for k to grow; below it k shrinks."""
    window: int = Field(10, gt=0)
    """Steps per decision: the ESS ratios of this many steps are averaged, then k moves and a new window starts."""
    decrease_factor: float = Field(0.5, gt=0, lt=1)
    """Multiplicative decrease of k after a window whose mean ESS ratio is below ess_target."""
    increase_step: int = Field(4, gt=0)
    """Additive increase of k after a window whose mean ESS ratio reaches ess_target."""

    @model_validator(mode="after")
    def _ordered(self) -> AutoStalenessConfig:
        if self.k_max <= self.k_min:
            raise ValueError(f"async.auto.k_max={self.k_max} must be above async.auto.k_min={self.k_min}")
        if self.k_start is not None and not self.k_min <= self.k_start <= self.k_max:
            raise ValueError(f"async.auto.k_start={self.k_start} must lie within [async.auto.k_min, "
                             f"async.auto.k_max] = [{self.k_min}, {self.k_max}]")
        return self


class AsyncConfig(_Strict):
    """Where the training trajectories come from in time: how stale a policy may have sampled them."""

    mode: Literal["sync", "lagged", "async"] = "async"
    """``sync``: sampled by the current policy; ``lagged``: always exactly max_staleness steps behind (a controlled
    lag for studies); ``async``: rollout workers run beside the learner, at most max_staleness steps behind."""
    max_staleness: int | Literal["auto"] = 2
    """k: the largest allowed policy lag of any token, in optimizer steps; ``auto``: a bound that follows the ESS
    ratio within the bounds of ``async.auto`` (lagged and async modes; docs/trainer.md, adaptive staleness)."""
    drop_older_than: float | None = Field(None, ge=0)
    """ROLL-Flash alpha: drop samples created more than alpha steps behind the trainer."""
    batch_order: Literal["arrival", "admission"] = "arrival"
    """Which finished groups a step takes (async mode, local backend): ``arrival``, the first to finish (a long,
    hard group overtaken by short ones may then exceed the bound and be dropped, so on a long-tailed task the trained
    groups can come out shorter and easier than the generated ones; the tool task showed no such bias,
    benchmarks/RESULTS.md); ``admission``, the groups in the order the bound admitted them, admitting within min(k,
    ceil(drop_older_than)): no group dropped for staleness at a fixed k, the trained groups are the generated ones, at
    the cost of waiting for each step's slowest group. Either order resumes losslessly (docs/trainer.md)."""
    inflight_updates: bool = True
    """Apply new weights between decode steps, so one response may span versions."""
    num_workers: int = Field(1, gt=0)
    """Rollout worker processes (or Ray actors) in async mode."""
    max_worker_restarts: int = Field(3, ge=0)
    """A rollout worker that dies is restarted (its groups re-issued) this many times in all, then the run stops."""
    handoff_timeout_s: float = Field(300.0, gt=0)
    """The longest the learner waits on a worker: for a weight lock, or for any group while it holds some."""
    backend: Literal["local", "ray"] = "local"
    """Where async mode's rollout workers and the learner run: local processes, or Ray actors (docs/ray.md)."""
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    auto: AutoStalenessConfig = Field(default_factory=AutoStalenessConfig)

    @field_validator("max_staleness", mode="before")
    @classmethod
    def _int_or_auto(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        raise ValueError("must be an integer >= 0 or auto")

    @model_validator(mode="after")
    def _auto_needs_a_lag(self) -> AsyncConfig:
        if self.is_auto and self.mode == "sync":
            raise ValueError("async.max_staleness=auto needs async.mode=lagged or async (sync mode has no lag)")
        return self

    @model_validator(mode="after")
    def _admission_order_fits(self) -> AsyncConfig:
        if self.batch_order == "admission" and (self.mode != "async" or self.backend != "local"):
            raise ValueError(f"async.batch_order=admission needs async.mode=async with async.backend=local (got mode "
                             f"{self.mode}, backend {self.backend}): sync and lagged batches are in order already, and "
                             "the Ray backend takes groups as they arrive")
        return self

    @property
    def is_auto(self) -> bool:
        """Whether the bound adapts to the ESS ratio (``max_staleness: auto``)."""
        return self.max_staleness == "auto"

    def initial_staleness(self) -> int:
        """The bound k of the first step: the fixed k, or auto's k_start (k_min when unset)."""
        if not self.is_auto:
            return self.max_staleness
        return self.auto.k_min if self.auto.k_start is None else self.auto.k_start

    def generation_bound(self) -> int:
        """The staleness bound the rollout source starts with: replay's generation_lag when set, else the first
        step's k (with ``auto`` the trainer then moves it, ``generation_follows_bound``)."""
        lag = self.replay.generation_lag
        return lag if self.replay.enabled and lag is not None else self.initial_staleness()

    def generation_follows_bound(self) -> bool:
        """Whether the rollout source's own bound moves with k (no fixed replay generation_lag)."""
        return not (self.replay.enabled and self.replay.generation_lag is not None)


class RayConfig(_Strict):
    """The Ray backend (async.backend=ray, docs/ray.md); ignored otherwise."""

    address: str | None = None
    """None = start a local Ray instance for the run (bound to localhost); ``auto`` or HOST:PORT joins a cluster."""
    num_cpus: int | None = Field(None, gt=0)
    """CPUs of the local instance; None = what the actors ask for (workers' plus learners')."""
    timeout_s: float = Field(300.0, gt=0)
    """Limit on every remote call once the actors have started (a rollout request, a learner step, a collective); a
    failed weight broadcast is formed again no sooner than this after the failure."""
    max_restarts: int = Field(2, ge=0)
    """Times Ray restarts a dead rollout actor (its in-flight groups are re-issued); learners are not restarted."""
    worker_num_cpus: float = Field(1.0, ge=0)
    """CPUs Ray reserves for each rollout actor."""
    worker_num_gpus: float = Field(0.0, ge=0)
    """GPUs (or a fraction of one) Ray reserves for each rollout actor."""
    learner_num_cpus: float = Field(1.0, ge=0)
    """CPUs Ray reserves for each learner rank."""
    learner_num_gpus: float = Field(0.0, ge=0)
    """GPUs (or a fraction of one) Ray reserves for each learner rank."""
    weight_sync: Literal["object_store", "broadcast"] = "object_store"
    """How new weights reach in-process rollout actors: fetched from the object store, or broadcast by learner rank 0
    in a process group of its own (NCCL on GPUs, gloo on CPU; the object store stays the fallback)."""
    rollout_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each rollout actor also needs, e.g. {rollout: 1}: only nodes started with that resource
    (``ray start --resources='{"rollout": 4}'``) take rollout actors. A local instance is given what the run needs."""
    learner_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each learner rank also needs (a bundle of the learner group's placement group)."""
    rollout_scheduling: Literal["spread", "default"] = "spread"
    """Where Ray puts the rollout actors among the nodes that fit them: spread over as many nodes as it can
    (Ray's SPREAD), or Ray's default (fill the nodes it prefers first)."""
    learner_placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = "pack"
    """Strategy of the learner group's placement group (one bundle per rank, all reserved at once or none):
    pack / spread are preferences, strict_pack one node, strict_spread a node per rank."""
    start_timeout_s: float = Field(300.0, gt=0)
    """How long the actors may take to start: the learner group's placement group to fit the cluster (past it, one
    line naming what did not fit), then each learner rank and rollout actor to load its model and task."""

    @field_validator("rollout_resources", "learner_resources")
    @classmethod
    def _custom_resources(cls, v: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        key = f"config key 'ray.{info.field_name}'"
        for name, amount in v.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{key}: {name} is set by ray.worker_num_cpus/gpus and ray.learner_num_cpus/gpus, "
                                 f"not as a custom resource")
            if not amount > 0:
                raise ValueError(f"{key}: resource {name!r} needs an amount > 0 (got {amount:g})")
        return v

    def demands(self, workers: int, learners: int) -> dict[str, float]:
        """Custom resources the run's actors need in all (a local instance is started with them)."""
        total: dict[str, float] = {}
        for each, count in ((self.rollout_resources, workers), (self.learner_resources, learners)):
            for name, amount in each.items():
                total[name] = total.get(name, 0.0) + amount * count
        return total


class RuntimeConfig(_Strict):
    """Process settings."""

    torch_threads: int = Field(1, gt=0)
    """Intra-op threads per process. One is fastest for the tiny default model on a shared 2-core
    machine (measured 3-5x faster per step than 2), and async mode runs two processes."""


class LoggingConfig(_Strict):
    """What a run reports beside metrics.jsonl (always written)."""

    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = []
    """Trackers that also receive every metrics.jsonl line (docs/trackers.md), each an extra of its name
    (``pip install 'vcpo[wandb]'``): ``tensorboard`` (events under {run_dir}/tensorboard), ``wandb`` (files under
    {run_dir}/wandb; ``WANDB_MODE=offline`` keeps them there for ``wandb sync``), ``mlflow`` (at
    ``MLFLOW_TRACKING_URI``, else the SQLite store {run_dir}/mlflow.db), ``trackio`` (its local store). The old key
    ``tensorboard: true`` still means ``[tensorboard]``."""
    project: str = "vcpo"
    """The W&B project, MLflow experiment and trackio project the run reports to."""
    run_name: str | None = None
    """The run's name in the trackers; None = the run directory's name."""
    progress: bool = True
    """Show a progress bar and warm-start messages on the terminal."""

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_key(cls, data: Any) -> Any:
        """``tensorboard: true`` (the key before report_to) adds tensorboard to report_to; ``false`` is dropped."""
        if isinstance(data, dict) and "tensorboard" in data:
            data = dict(data)
            if data.pop("tensorboard") is True:
                reported = list(data.get("report_to") or [])
                data["report_to"] = reported if "tensorboard" in reported else [*reported, "tensorboard"]
        return data

    @field_validator("report_to")
    @classmethod
    def _each_once(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"names a tracker twice: {v}")
        return v


class Config(_Strict):
    """A run: every key has a default, and the defaults are configs/quickstart.yaml (the README's main command)."""

    seed: int = 0
    """The run's seed: torch's RNG, the training problem stream, the held-out problems, rollout sampling, and the
    warm start unless sft.seed is set."""
    run_dir: str = "runs/quickstart"
    """Where the run writes config.yaml, metrics.jsonl, checkpoints/ and summary.json (`vcpo plot` adds plots/)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    ray: RayConfig = Field(default_factory=RayConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True,
                              use_attribute_docstrings=True)

    @model_validator(mode="after")
    def _objective_hyperparameters(self) -> Config:
        """Type, range and choices of ``objective.{loss_agg,max_len,kwargs}`` by the objective's spec."""
        obj = self.objective
        for key in ("loss_agg", "max_len"):
            if key in obj.kwargs:
                raise ValueError(f"objective.kwargs.{key}: set it as objective.{key}")
        given = dict(obj.kwargs)
        given |= {k: v for k, v in (("loss_agg", obj.loss_agg), ("max_len", obj.max_len)) if v is not None}
        try:
            coerced = check_hyperparameters(obj.name, given)
        except HyperparameterError as e:
            key = f"objective.{e.name}" if e.name in ("loss_agg", "max_len") else f"objective.kwargs.{e.name}"
            raise ValueError(f"config key {key!r} of objective {obj.name!r}: {e.reason}") from None
        if obj.max_len is not None and coerced.get("loss_agg", spec_of(obj.name)["loss_agg"].default) != SUM_NORM:
            raise ValueError(f"config key 'objective.max_len' is used only by objective.loss_agg={SUM_NORM}")
        obj.kwargs.update({k: v for k, v in coerced.items() if k in obj.kwargs})  # "1e3" -> 1000.0, in place
        if obj.name not in BUILTIN_OBJECTIVES:
            from vcpo.objectives.registry import check_objective

            try:
                check_objective(obj.name, **coerced)
            except ValueError as e:
                raise ValueError(f"config key 'objective.name': {e}") from None
        return self

    @model_validator(mode="after")
    def _chat_needs_a_model(self) -> Config:
        if self.task.prompt_format == "chat" and self.model.path is None:
            raise ValueError("task.prompt_format=chat needs model.path: the embedded default model's tokenizer has "
                             "no chat template")
        return self

    @model_validator(mode="after")
    def _replay_fits(self) -> Config:
        replay, ac = self.async_.replay, self.async_
        if not replay.enabled:
            return self
        per_step = max(replay.groups_per_step or 0, self.rollout.prompts_per_step)
        if replay.capacity < per_step:
            raise ValueError(f"async.replay.capacity={replay.capacity} must hold at least one step's groups "
                             f"({per_step}: rollout.prompts_per_step / async.replay.groups_per_step)")
        # With auto, the buffer's age limit follows k down to k_min: the generation lag must fit the lowest k.
        k, name = (ac.auto.k_min, "async.auto.k_min") if ac.is_auto else (ac.max_staleness, "async.max_staleness")
        lag = replay.generation_lag
        if lag is not None and lag > k:
            raise ValueError(f"async.replay.generation_lag={lag} exceeds {name}={k}, the bound on every token "
                             f"trained on")
        if ac.mode == "lagged" and (lag is None or lag == k):
            raise ValueError(f"async.replay.generation_lag must be below {name}={k} in lagged mode: fresh groups "
                             f"arrive exactly that old, so none could ever be replayed")
        return self

    @model_validator(mode="after")
    def _filter_needs_groups(self) -> Config:
        if self.rollout.filter != "none" and self.rollout.group_size < 2:
            raise ValueError(f"rollout.filter={self.rollout.filter} needs rollout.group_size >= 2 (got "
                             f"{self.rollout.group_size}): a group of one has no reward spread to judge")
        low, high = self.rollout.filter_pass_rate
        if low > high:
            raise ValueError(f"rollout.filter_pass_rate=[{low:g}, {high:g}]: the low end is above the high end")
        if (low, high) != (0.0, 1.0) and self.rollout.filter == "none":
            raise ValueError(f"rollout.filter_pass_rate=[{low:g}, {high:g}] needs rollout.filter=zero_variance (got "
                             f"none): the band only chooses among the groups dynamic sampling judges")
        return self

    @model_validator(mode="after")
    def _servers_named(self) -> Config:
        server = self.rollout.server
        if self.rollout.engine == "server" and not server.urls and server.launch is None:
            raise ValueError("rollout.engine=server needs rollout.server.urls (a list of base URLs) or "
                             "rollout.server.launch (servers the run starts)")
        return self

    @model_validator(mode="after")
    def _lora_servers(self) -> Config:
        if self.model.lora.rank > 0 and self.rollout.engine == "server" and self.rollout.server.kind == "sglang":
            raise ValueError("model.lora.rank>0 with rollout.server.kind=sglang: adapter sync reaches vcpo serve and "
                             "vLLM only (set rollout.server.kind=vcpo or vllm, or model.lora.rank=0)")
        if self.model.lora.rank > 512 and self.rollout.engine == "server" and self.rollout.server.kind == "vllm":
            raise ValueError(f"model.lora.rank={self.model.lora.rank} with rollout.server.kind=vllm: vLLM serves "
                             "adapters of rank 512 at most (--max-lora-rank)")
        return self

    @model_validator(mode="after")
    def _backend_fits(self) -> Config:
        learners = self.trainer.num_learners
        if self.async_.backend == "ray" and self.async_.mode != "async":
            raise ValueError(f"async.backend=ray needs async.mode=async (got {self.async_.mode!r})")
        if self.ray.weight_sync == "broadcast" and self.async_.backend == "ray" and self.rollout.engine == "server":
            raise ValueError("ray.weight_sync=broadcast is for in-process rollout actors: with rollout.engine=server "
                             "the servers get the weights through rollout.server")
        if self.trainer.sharding == "fsdp":
            _check_sharding(self)
        groups = self.async_.replay.groups_per_step if self.async_.replay.enabled else None
        if learners > (groups or self.rollout.prompts_per_step):
            raise ValueError(f"trainer.num_learners={learners} exceeds the groups per step "
                             f"({groups or self.rollout.prompts_per_step}): each rank trains on whole groups")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


def _check_sharding(config: Config) -> None:
    """What ``trainer.sharding=fsdp`` cannot be combined with, one line each (docs/scaling.md)."""
    if config.advantage.estimator == "opob" and config.advantage.grad_norm_method == "exact":
        raise ValueError("advantage.grad_norm_method=exact with trainer.sharding=fsdp: a sharded backward sums every "
                         "rank's rows; use fast or logit_proxy")
    if config.model.lm_head_fp32:
        raise ValueError("model.lm_head_fp32 with trainer.sharding=fsdp: the sharded LM head is whole only inside "
                         "the model's forward, in model.dtype")
    if config.async_.backend == "ray" and config.ray.weight_sync == "broadcast":
        raise ValueError("ray.weight_sync=broadcast with trainer.sharding=fsdp: no rank holds the whole model; use "
                         "object_store")


KWARGS_OF_NAME = {"task.name": "task.kwargs", "objective.name": "objective.kwargs"}
"""Keys whose ``kwargs`` belong to the named thing: an override that changes the name drops the file's kwargs."""


def _section_of(dotted: str) -> type[BaseModel] | None:
    """The model class of a config section (``trainer``, ``trainer.ess_lr``), None for a leaf or an unknown key."""
    model: type[BaseModel] | None = Config
    for key in dotted.split("."):
        fields = {f.alias or name: f for name, f in model.model_fields.items()} if model else {}
        field = fields.get(key)
        annotation = field.annotation if field is not None else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if model is None:
            return None
    return model


def _merge(into: dict[str, Any], value: dict[str, Any], dotted: str) -> None:
    """Deep-merge ``value`` into a section, replacing leaves; a dict-typed leaf (``kwargs``) is replaced whole."""
    for key, item in value.items():
        if isinstance(item, dict) and _section_of(f"{dotted}.{key}") is not None and isinstance(into.get(key), dict):
            _merge(into[key], item, f"{dotted}.{key}")
        else:
            into[key] = item


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set one override: a leaf (a dict-typed one such as ``task.kwargs`` too) is replaced; a mapping given for a
    section (``trainer={lr: 1e-3}``) is merged into what the file set there."""
    keys = dotted.split(".")
    node = tree
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {'.'.join(keys[: i + 1])} is not a section")
        node = child
    if isinstance(value, dict) and isinstance(node.get(keys[-1]), dict) and _section_of(dotted) is not None:
        _merge(node[keys[-1]], value, dotted)
    else:
        node[keys[-1]] = value


def _get_dotted(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> list[str]:
    """Apply dotted overrides to a config tree read from a file, in place.

    ``task.name`` or ``objective.name`` set to another name than the file's (or the default's) first drops the
    file's ``task.kwargs`` / ``objective.kwargs``: they were written for the old task or objective. Kwargs given as
    overrides (``task.kwargs.path=...``) apply after that, whatever their order on the command line. Returns one note
    per non-empty kwargs dropped (``load_config`` logs them once the config is valid).
    """
    parsed, notes = parse_overrides(overrides), []
    for name_key, kwargs_key in KWARGS_OF_NAME.items():
        section, field = name_key.split(".")
        names = [value for key, value in parsed if key == name_key]
        current = _get_dotted(tree, name_key)
        if current is None:
            current = _section_of(section).model_fields[field].default
        if names and names[-1] != current and isinstance(tree.get(section), dict):
            dropped = tree[section].pop(kwargs_key.split(".")[1], None)
            if dropped:
                keys = ", ".join(map(str, dropped)) if isinstance(dropped, dict) else repr(dropped)
                notes.append(f"note: {name_key}={names[-1]} replaces {current}, so the file's {kwargs_key} ({keys}) "
                             f"are dropped; give the new one its own as {kwargs_key}.KEY=VALUE")
    for key, value in parsed:
        _set_dotted(tree, key, value)
    return notes


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["a.b=1", "c=x"]`` -> ``[("a.b", 1), ("c", "x")]``; values are parsed as YAML scalars."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: cannot parse value ({exc.__class__.__name__})") from None
        parsed.append((key.strip(), value))
    return parsed


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "config"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return f"unknown config key {where!r}"
    if not err["loc"] or (err["type"] == "value_error" and isinstance(err.get("input"), dict)):
        return msg  # a cross-field check of the config or of a section: its message already names the key
    return f"config key {where!r}: {msg} (got {err.get('input')!r})"


def config_from_dict(tree: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_first_error(exc)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or start from defaults), apply dotted overrides, validate. Kwargs an override of
    ``task.name`` / ``objective.name`` dropped are said in one warning line each on the ``vcpo.config`` logger (on
    stderr when nothing configured logging), after validation, so that a bad config still fails in one line."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            where = _yaml_where(exc)
            raise ConfigError(f"config file {str(p)!r}{where} is not valid YAML: {_yaml_problem(exc)}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {str(p)!r} cannot be read: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    notes = apply_overrides(tree, overrides or [])
    config = config_from_dict(tree)
    for note in notes:
        log.warning(note)
    return config


def _yaml_where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def _yaml_problem(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None)
    return " ".join(str(problem or exc).split())


def save_config(config: Config, path: str | Path) -> None:
    """Write ``config.yaml`` atomically (a temporary file renamed over it): a crash never leaves half a config."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(yaml.safe_dump(config.to_dict(), sort_keys=False))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DiskError(path, e) from None
