"""``async`` (with ``async.replay``, ``async.auto`` and ``async.ray``): staleness, its bound, the backends."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from vcpo.config.base import _Strict


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


