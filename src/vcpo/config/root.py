"""``Config``: every section together, and the checks that span sections."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from vcpo.config.asynchrony import AsyncConfig, RayConfig
from vcpo.config.base import _Strict
from vcpo.config.model import ModelConfig, SFTConfig
from vcpo.config.objective import AdvantageConfig, ObjectiveConfig
from vcpo.config.recipe import DEFAULT_RECIPE, Recipe, fill_recipe
from vcpo.config.rollout import RolloutConfig
from vcpo.config.runtime import LoggingConfig, RuntimeConfig
from vcpo.config.task import TaskConfig
from vcpo.config.trainer import TrainerConfig
from vcpo.objective_specs import (
    BUILTIN_OBJECTIVES,
    SUM_NORM,
    HyperparameterError,
    check_hyperparameters,
    spec_of,
)


class Config(_Strict):
    """A run: every key has a default, and the defaults are configs/quickstart.yaml (the README's main command)."""

    recipe: Recipe = DEFAULT_RECIPE
    """The method for the keys a config leaves out (docs/variance.md, "the stable recipe"): ``stable``, VESPO's
    kernel with VCPO's controls (objective vespo, OPOB grad_only with logit-proxy norms, ESS learning rate), best or
    within noise of the best at every setting and staleness the studies measured; ``paper``, VCPO as its paper writes
    it (objective vcpo, plug-in OPOB with ghost gradient norms, ESS learning rate). Keys the config sets always win."""
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

    @model_validator(mode="before")
    @classmethod
    def _fill_recipe(cls, data: Any) -> Any:
        """The recipe's keys, where the raw config leaves them out (vcpo.config.recipe)."""
        return fill_recipe(data) if isinstance(data, dict) else data

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


