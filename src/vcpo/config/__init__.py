"""Run configuration: pydantic models, YAML loading, dotted command-line overrides.

``load_config(path, ["trainer.lr=1e-4", ...])`` returns a validated ``Config``; any unknown key or
bad value raises ``ConfigError`` with one line naming it. The resolved config is saved with the run.
Torch-free: every check here (objective hyperparameters included) runs before any heavy import.

One module per section (``model``, ``task``, ``rollout``, ``objective``, ``trainer``, ``asynchrony`` for ``async``,
``runtime``), ``root`` for ``Config`` and its cross-section checks, ``loader`` for files and overrides; every name is
importable from here.
"""

from __future__ import annotations

from vcpo.config.asynchrony import AsyncConfig, AutoStalenessConfig, RayConfig, ReplayConfig
from vcpo.config.base import ConfigError
from vcpo.config.loader import (
    KWARGS_OF_NAME,
    apply_overrides,
    config_from_dict,
    load_config,
    load_run_config,
    parse_overrides,
    save_config,
)
from vcpo.config.model import ArchitectureConfig, LoraConfig, ModelConfig, SFTConfig
from vcpo.config.objective import AdvantageConfig, ObjectiveConfig
from vcpo.config.rollout import LaunchConfig, RolloutConfig, ServerConfig
from vcpo.config.root import Config
from vcpo.config.runtime import LoggingConfig, RuntimeConfig
from vcpo.config.task import TaskConfig
from vcpo.config.trainer import AlarmRule, ESSLRConfig, HealthConfig, TrainerConfig

__all__ = ["KWARGS_OF_NAME", "AdvantageConfig", "AlarmRule", "ArchitectureConfig", "AsyncConfig", "AutoStalenessConfig",
           "Config", "ConfigError", "ESSLRConfig", "HealthConfig", "LaunchConfig", "LoggingConfig", "LoraConfig",
           "ModelConfig", "ObjectiveConfig", "RayConfig", "ReplayConfig", "RolloutConfig", "RuntimeConfig",
           "SFTConfig", "ServerConfig", "TaskConfig", "TrainerConfig", "apply_overrides", "config_from_dict",
           "load_config", "load_run_config", "parse_overrides", "save_config"]
