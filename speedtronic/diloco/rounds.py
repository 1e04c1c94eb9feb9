"""The data of a DumbDiLoCo round: its phase, a delta on its way out, a global on its way in."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import torch

from speedtronic.diloco import tensors as T

__all__ = ["DeltaUploadJob", "GlobalCandidate", "RoundPhase"]


class RoundPhase(str, enum.Enum):
    """Where this node is in the current round."""

    SNAPSHOT = "snapshot"
    INNER = "inner"
    PUSH = "push"
    COMMIT = "commit"


@dataclasses.dataclass
class DeltaUploadJob:
    """One delta on its way to the transport (``target_state`` = weights at dispatch)."""

    step: int
    base_outer_step: int
    generation: int
    delta: dict[str, torch.Tensor]
    target_state: dict[str, torch.Tensor]

    def to_dict(self) -> dict[str, Any]:
        """Checkpointable form (CPU clones)."""
        return {
            "step": self.step,
            "base_outer_step": self.base_outer_step,
            "generation": self.generation,
            "delta": T.cpu_state_dict(self.delta),
            "target_state": T.cpu_state_dict(self.target_state),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeltaUploadJob:
        """Rebuild a checkpointed job (CPU clones)."""
        return cls(
            int(data["step"]),
            int(data["base_outer_step"]),
            int(data["generation"]),
            T.cpu_state_dict(data["delta"]),
            T.cpu_state_dict(data["target_state"]),
        )


@dataclasses.dataclass
class GlobalCandidate:
    """A downloaded global waiting for the training thread."""

    outer_step: int
    state: dict[str, torch.Tensor]
    seconds: float = 0.0
