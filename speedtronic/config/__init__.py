"""Speedtronic configuration: typed sections, loading, env/secret layering.

Public API::

    SpeedtronicConfig.from_dict / from_yaml / load, .to_dict / to_yaml / save
    SpeedtronicConfig.from_canonical(mapping)   # canonical data only; from_dict normalises
    config.effective_max_steps          # data.max_steps or run.max_steps
    config.apply_run_target(n)          # change the run target in place; an implicit
                                        # scheduler horizon follows (explicit ones are kept)
    config.with_max_steps(n)            # same, on a deep copy
    config.sync_scheduler_horizon()     # after mutating run/data.max_steps directly
    config.checkpoint_dir / state_dir / events_path / text_log_path / resolve_output_path(p)
                                        # relative paths are under run.output_dir
    load_config(source), load_yaml_config(path), ConfigError(ValueError)
    resolve_config(source, *, environ=None, secrets_dir=None, overrides=()) -> ResolvedConfig

Importing this package never imports torch and never reads the environment.
"""

from __future__ import annotations

from pathlib import Path

from speedtronic.config.layering import ResolvedConfig, resolve_config
from speedtronic.config.limits import ConfigError, ConfigFileNotFoundError
from speedtronic.config.ops_sections import (
    CheckpointConfig,
    DistributedConfig,
    LoggingConfig,
    MetricsConfig,
    ShapeValidationConfig,
)
from speedtronic.config.redaction import REDACTED
from speedtronic.config.schema import Config, SpeedtronicConfig
from speedtronic.config.sections import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    RunConfig,
    RuntimeConfig,
    SchedulerConfig,
)

__all__ = [
    "REDACTED",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ConfigFileNotFoundError",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "LoggingConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "ResolvedConfig",
    "RunConfig",
    "RuntimeConfig",
    "SchedulerConfig",
    "ShapeValidationConfig",
    "SpeedtronicConfig",
    "load_config",
    "load_yaml_config",
    "resolve_config",
]


def load_config(source: object) -> SpeedtronicConfig:
    """Same as :meth:`SpeedtronicConfig.load` (mapping, inline YAML/JSON, or path)."""
    return SpeedtronicConfig.load(source)


def load_yaml_config(path: str | Path) -> SpeedtronicConfig:
    """Same as :meth:`SpeedtronicConfig.from_yaml`."""
    return SpeedtronicConfig.from_yaml(path)
