"""Speedtronic: a PyTorch pre-training job runner with DumbDiLoCo rounds.

Importing the package is cheap: every public name is resolved lazily through module
``__getattr__`` the first time it is asked for, so ``import speedtronic`` loads neither torch
nor the Hub SDK, and ``speedtronic.config`` stays importable without a GPU stack.

Importing it changes no import machinery either. The 2.0.0 module paths
(``speedtronic.runtime``, ``speedtronic.trainer``, ``speedtronic.distributed``, ...) are small
module files that fetch their names through the alias table in :mod:`speedtronic.compat`, with a
``DeprecationWarning``, when they are imported.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "2.1.0"

# name -> module that defines it; imported on first attribute access.
_LAZY: dict[str, str] = {
    "CheckpointConfig": "speedtronic.config",
    "Config": "speedtronic.config",
    "ConfigError": "speedtronic.config",
    "DataConfig": "speedtronic.config",
    "DistributedConfig": "speedtronic.config",
    "EvalConfig": "speedtronic.config",
    "LoggingConfig": "speedtronic.config",
    "MetricsConfig": "speedtronic.config",
    "ModelConfig": "speedtronic.config",
    "OptimizerConfig": "speedtronic.config",
    "PrecisionConfig": "speedtronic.config",
    "RunConfig": "speedtronic.config",
    "SchedulerConfig": "speedtronic.config",
    "ShapeValidationConfig": "speedtronic.config",
    "SpeedtronicConfig": "speedtronic.config",
    "load_config": "speedtronic.config",
    "load_yaml_config": "speedtronic.config",
    "ModelRegistry": "speedtronic.model",
    "registry": "speedtronic.model",
    "register_model": "speedtronic.model",
    "build_model": "speedtronic.model",
    "set_gradient_checkpointing": "speedtronic.module_utils",
    "GPT": "speedtronic.model",
    "GPTConfig": "speedtronic.model",
    "ReferenceTransformer": "speedtronic.model",
    "Trainer": "speedtronic.train.trainer",
    "TrainResult": "speedtronic.train.trainer",
    "build_runtime": "speedtronic.train.runtime",
    "train_from_config": "speedtronic.train.runtime",
    "DumbDiLoCo": "speedtronic.diloco",
    "DumbDiLoCoCoordinator": "speedtronic.diloco",
    "HubClient": "speedtronic.diloco.hub",
    "Muon": "speedtronic.optim",
    "HybridOptimizer": "speedtronic.optim",
    "CautiousOptimizer": "speedtronic.optim",
    "newton_schulz": "speedtronic.optim",
    "route_parameters": "speedtronic.optim",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    """Resolve the heavy public names on first use (PEP 562)."""
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(name)
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
