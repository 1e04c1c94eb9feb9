"""Muon's Newton–Schulz working dtype: ``optimizer.muon_ns_dtype`` (issue 13, deliverable 5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import speedtronic.optim.muon as muon_module
from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.model import ReferenceTransformer
from speedtronic.optim import (
    HybridOptimizer,
    Muon,
    MuonSettings,
    build_optimizer,
    newton_schulz,
    orthogonal_direction,
    resolve_ns_dtype,
)
from speedtronic.optim.muon import _detect_cpu_native_bf16


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Set what the CPU capability detection reports: ``cpu_bf16(True)`` / ``cpu_bf16(False)``."""

    def set_native(native: bool) -> None:
        monkeypatch.setattr(muon_module, "cpu_has_native_bf16", lambda: native)

    return set_native


# --------------------------------------------------------------------------- resolution
@pytest.mark.parametrize("device", ["cpu", "cuda:0", "meta", "mps"])
def test_explicit_settings_are_taken_as_given_on_any_device(device):
    assert resolve_ns_dtype("bf16", device) == torch.bfloat16
    assert resolve_ns_dtype(" FP32 ", device) == torch.float32


def test_auto_on_cpu_follows_the_capability_detection(cpu_bf16):
    cpu_bf16(True)
    assert resolve_ns_dtype("auto", "cpu") == torch.bfloat16
    cpu_bf16(False)
    assert resolve_ns_dtype("auto", torch.device("cpu")) == torch.float32


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16), ((7, 5), torch.float32)],
)
def test_auto_on_cuda_is_bf16_from_ampere_on(monkeypatch, cpu_bf16, capability, expected):
    cpu_bf16(False)  # the CPU answer must not leak into the CUDA one
    monkeypatch.setattr(torch.version, "hip", None)
    seen = []
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda device: seen.append(device) or capability
    )
    assert resolve_ns_dtype("auto", "cuda:1") == expected
    assert seen == [torch.device("cuda:1")]


def test_auto_on_rocm_is_bf16(monkeypatch, cpu_bf16):
    cpu_bf16(False)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert resolve_ns_dtype("auto", "cuda") == torch.bfloat16


def test_auto_on_other_devices_is_fp32(cpu_bf16):
    cpu_bf16(True)
    assert resolve_ns_dtype("auto", "meta") == torch.float32
    assert resolve_ns_dtype("auto", "mps") == torch.float32


@pytest.mark.parametrize("bad", ["fp16", "bfloat16", "", "float32", None, 3])
def test_unknown_settings_are_value_errors(bad):
    with pytest.raises(ValueError, match="ns_dtype must be 'auto', 'bf16' or 'fp32'"):
        resolve_ns_dtype(bad, "cpu")
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([nn.Parameter(torch.zeros(2, 2))], ns_dtype=bad)
    with pytest.raises(ValueError, match="ns_dtype"):
        HybridOptimizer([], [nn.Parameter(torch.zeros(2))], muon_lr=0.1, adamw_lr=0.1,
                        muon=MuonSettings(ns_dtype=bad))  # fmt: skip


# --------------------------------------------------------------------------- CPU detection
def _no_torch_probes(monkeypatch) -> None:
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False, raising=False)


@pytest.mark.parametrize(
    ("text", "native"),
    [
        ("flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n", False),
        ("flags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n", True),
        ("flags\t\t: fpu avx512f amx_tile amx_bf16 amx_int8\n", True),
        ("Features\t: fp asimd sve i8mm bf16 svebf16\n", True),
        ("Features\t: fp asimd evtstrm aes crc32\n", False),
        ("model name\t: bf16 in a name is not a flag\n", False),
    ],
)
def test_cpuinfo_flags_decide_when_torch_probes_say_no(monkeypatch, tmp_path, text, native):
    _no_torch_probes(monkeypatch)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\n" + text + "\nprocessor\t: 1\n" + text)
    assert _detect_cpu_native_bf16(str(cpuinfo)) is native


def test_torch_probes_win_and_failures_fall_back_to_cpuinfo(monkeypatch, tmp_path):
    missing = str(tmp_path / "absent")
    _no_torch_probes(monkeypatch)
    assert _detect_cpu_native_bf16(missing) is False  # unreadable cpuinfo: no bf16
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert _detect_cpu_native_bf16(missing) is True

    def broken() -> bool:
        raise RuntimeError("cpuinfo could not be initialised")

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", broken, raising=False)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    assert _detect_cpu_native_bf16(missing) is False
    flagged = tmp_path / "cpuinfo"
    flagged.write_text("flags : avx512_bf16\n")
    assert _detect_cpu_native_bf16(str(flagged)) is True


def test_cached_detection_returns_a_bool():
    assert isinstance(muon_module.cpu_has_native_bf16(), bool)


# --------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("shape", [(32, 96), (48, 128), (128, 48)])  # well conditioned
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_and_fp32_newton_schulz_both_orthogonalize(shape, dtype):
    """Singular values land in Keller Jordan's band around 1 in either working dtype."""
    torch.manual_seed(3)
    matrix = torch.randn(*shape)
    result = newton_schulz(matrix, steps=5, dtype=dtype)
    assert result.dtype == dtype
    singular = torch.linalg.svdvals(result.float())
    assert singular.min() > 0.6 and singular.max() < 1.25
    u, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    polar = u @ vh
    assert (result.float() - polar).norm() / polar.norm() < 0.35


def test_bf16_direction_is_fp32_close_to_fp32_and_buffers_match():
    torch.manual_seed(4)
    grad = torch.randn(96, 32)
    buffers = {dtype: torch.randn(96, 32) for dtype in (torch.float32, torch.bfloat16)}
    buffers[torch.bfloat16].copy_(buffers[torch.float32])
    out = {
        dtype: orthogonal_direction(grad, buffer, momentum=0.9, ns_dtype=dtype)
        for dtype, buffer in buffers.items()
    }
    assert out[torch.bfloat16].dtype == torch.float32  # returned fp32 whatever the NS dtype
    assert buffers[torch.bfloat16].dtype == torch.float32
    assert torch.equal(buffers[torch.bfloat16], buffers[torch.float32])  # momentum is fp32 math
    relative = (out[torch.bfloat16] - out[torch.float32]).norm() / out[torch.float32].norm()
    assert 0 < relative < 0.05
    singular = torch.linalg.svdvals(out[torch.bfloat16])
    assert singular.min() > 0.6 and singular.max() < 1.25


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_momentum_buffer_stays_fp32_with_bf16_newton_schulz(param_dtype):
    generator = torch.Generator().manual_seed(5)
    params = [nn.Parameter(torch.randn(8, 8, generator=generator).to(param_dtype)) for _ in "ab"]
    params.append(nn.Parameter(torch.randn(8, 24, generator=generator).to(param_dtype)))
    optimizer = Muon(params, lr=0.02, ns_dtype="bf16")
    for _ in range(3):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(param_dtype)
        optimizer.step()
    for param in params:
        state = optimizer.state[param]
        assert state["momentum_buffer"].dtype == torch.float32 and state["step"] == 3
        assert param.dtype == param_dtype and torch.isfinite(param.float()).all()
    assert "ns_dtype" not in optimizer.state_dict()["param_groups"][0]  # speed, not state


def _stepped(ns_dtype: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(6)
    params = [nn.Parameter(torch.randn(16, 16, generator=generator)) for _ in "abc"]
    for param in params:
        param.grad = torch.randn(16, 16, generator=generator)
    Muon(params, lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype).step()
    return [param.detach() for param in params]


def test_muon_auto_uses_the_resolved_dtype_at_step(cpu_bf16):
    bf16, fp32 = _stepped("bf16"), _stepped("fp32")
    cpu_bf16(True)
    assert all(torch.equal(a, b) for a, b in zip(_stepped("auto"), bf16, strict=True))
    cpu_bf16(False)
    assert all(torch.equal(a, b) for a, b in zip(_stepped("auto"), fp32, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(bf16, fp32, strict=True))


# --------------------------------------------------------------------------- config path
def test_config_accepts_the_three_settings_case_insensitively():
    assert SpeedtronicConfig().optimizer.muon_ns_dtype == "auto"
    for text, expected in (("auto", "auto"), ("BF16", "bf16"), (" fp32 ", "fp32")):
        config = SpeedtronicConfig.from_dict({"optimizer": {"muon_ns_dtype": text}})
        assert config.optimizer.muon_ns_dtype == expected
        assert config.to_dict()["optimizer"]["muon_ns_dtype"] == expected


@pytest.mark.parametrize("bad", ["fp16", "bfloat16", "", 16, None, True, ["bf16"]])
def test_config_rejects_other_values(bad):
    with pytest.raises(
        ConfigError, match=r"optimizer\.muon_ns_dtype must be 'auto', 'bf16' or 'fp32', got "
    ):
        SpeedtronicConfig.from_dict({"optimizer": {"name": "muon", "muon_ns_dtype": bad}})


@pytest.mark.parametrize("setting", ["auto", "bf16", "fp32"])
def test_the_setting_reaches_the_muon_optimizer(setting):
    config = SpeedtronicConfig.from_dict({"optimizer": {"name": "muon", "muon_ns_dtype": setting}})
    model = ReferenceTransformer(
        vocab_size=32, block_size=8, n_layer=1, n_head=4, n_kv_head=2, d_model=32
    )
    optimizer = build_optimizer(model, config, "cpu")
    assert isinstance(optimizer, HybridOptimizer) and optimizer.muon is not None
    assert optimizer.muon.ns_dtype == setting
