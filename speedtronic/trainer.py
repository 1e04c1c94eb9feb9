"""Compatibility path (2.0.0): ``speedtronic.trainer`` → :mod:`speedtronic.train.trainer`."""

from speedtronic.train.trainer import (
    GradientOverflowError,
    NonFiniteLossError,
    SpeedtronicTrainer,
    SyncCoordinator,
    Trainer,
    TrainingEngine,
    TrainResult,
)

__all__ = [
    "GradientOverflowError",
    "NonFiniteLossError",
    "SpeedtronicTrainer",
    "SyncCoordinator",
    "TrainResult",
    "Trainer",
    "TrainingEngine",
]
