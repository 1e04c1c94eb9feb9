"""2.0.0 path of the coordinator (:mod:`speedtronic.diloco.coordinator`)."""

from speedtronic.diloco import DeltaUploadJob, SyncResult
from speedtronic.diloco.coordinator import DumbDiLoCo, DumbDiLoCoCoordinator
from speedtronic.diloco.node import GlobalCandidate

__all__ = ["DeltaUploadJob", "DumbDiLoCo", "DumbDiLoCoCoordinator", "GlobalCandidate", "SyncResult"]
