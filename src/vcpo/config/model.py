"""``model`` (with ``model.lora``) and ``sft`` (with ``sft.architecture``): the policy and its warm start."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from vcpo.config.base import _Strict


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


