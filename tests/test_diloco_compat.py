"""2.0.0 import paths keep working (speedtronic.distributed and its submodules)."""

# ruff: noqa: F811  (pytest fixtures imported from hub_emulator_fixtures)
from __future__ import annotations

import pytest
import torch
from hub_emulator_fixtures import hub_emulator, make_transport  # noqa: F401


def test_distributed_package_exports_the_2_0_0_names():
    import speedtronic
    import speedtronic.distributed as dist

    assert set(dist.__all__) == {
        "DumbDiLoCo",
        "DumbDiLoCoCoordinator",
        "GlobalMetadata",
        "HubClient",
        "HubError",
        "HubTransport",
        "HubUnavailable",
        "MasterOuterLoop",
        "NesterovOuterOptimizer",
        "SyncResult",
        "average_deltas",
        "compute_pseudo_gradient",
        "load_delta",
        "load_safetensors",
        "save_safetensors",
    }
    assert dist.DumbDiLoCo is dist.DumbDiLoCoCoordinator is speedtronic.DumbDiLoCoCoordinator
    assert dist.HubTransport is dist.HubClient is speedtronic.HubClient
    assert issubclass(dist.HubUnavailable, dist.HubError) and issubclass(
        dist.HubError, RuntimeError
    )
    assert dist.SyncResult() == dist.SyncResult(pushed=False, loaded_global=False, outer_step=0)


def test_submodules():
    from speedtronic.distributed import diloco, hub, outer, tensors

    assert tensors.parse_delta_path("nodes/a/delta_12.safetensors") == ("a", 12)
    assert tensors.parse_delta_path("global/latest.safetensors") is None
    state = {"w": torch.tensor([1.0, 1.0])}
    outer.NesterovOuterOptimizer(state, lr=1.0, momentum=0.9).step(
        state, {"w": torch.tensor([0.1, 0.2])}
    )
    assert torch.allclose(state["w"], torch.tensor([0.81, 0.62]))
    assert hub.HubClient.__name__ == "HubClient"
    assert diloco.DeltaUploadJob.__name__ == "Contribution"  # 2.0.0 name of the upload job
    assert outer.MasterOuterLoop.__name__ == "RoundMaster"


def test_global_metadata_accepts_legacy_step_key():
    from speedtronic.distributed import GlobalMetadata

    meta = GlobalMetadata.from_dict({"step": 4})
    assert meta.outer_step == 4 and meta.model_file == "global/latest.safetensors"


def test_distributed_delta_upload_job_imports():
    from speedtronic.diloco.node import Contribution
    from speedtronic.distributed import DeltaUploadJob

    assert DeltaUploadJob is Contribution


@pytest.mark.parametrize("kind", ["hub", "directory"])
def test_hub_client_2_0_0_calls(kind, make_transport, tmp_path):
    """``publish_global(..., work_dir=...)`` is accepted and ``upload_delta`` returns the
    remote path (2.0.0's signatures and return values)."""
    hub = make_transport(kind)
    hub.create_repo(private=True)
    state = {"weight": torch.tensor([1.0, 2.0])}
    meta = hub.publish_global(state, outer_step=0, work_dir=tmp_path / "outgoing")
    assert meta.outer_step == 0 and meta.model_file == "global/latest.safetensors"
    path = hub.upload_delta(
        {"weight": torch.tensor([0.5, 0.5])},
        node_id="node-a",
        local_step=1,
        base_outer_step=0,
        work_dir=tmp_path / "outgoing",
        metadata={"algorithm": "dumb_diloco"},
    )
    assert isinstance(path, str) and path == "nodes/node-a/delta_0.safetensors"
    delta, header = hub.read_delta(path)
    assert torch.equal(delta["weight"], torch.tensor([0.5, 0.5]))
    assert header["node_id"] == "node-a"
