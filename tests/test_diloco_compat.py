"""2.0.0 import paths keep working (speedtronic.distributed and its submodules)."""

from __future__ import annotations

import torch


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
