"""Compatibility path (2.0.0): ``speedtronic.runtime`` → :mod:`speedtronic.train.runtime`."""

from speedtronic.train.runtime import (
    build_logger,
    build_optimizer,
    build_runtime,
    build_scheduler,
    run,
    seed_everything,
    train,
    train_from_config,
)

__all__ = [
    "build_logger",
    "build_optimizer",
    "build_runtime",
    "build_scheduler",
    "run",
    "seed_everything",
    "train",
    "train_from_config",
]
