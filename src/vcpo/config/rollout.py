"""``rollout`` (with ``rollout.server`` and its ``launch``): how completions are sampled."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from vcpo.config.base import _Strict


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


