"""Startup shape validation: profiles, codes, suggestions, logging and events."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from speedtronic.config import SpeedtronicConfig
from speedtronic.model import ReferenceTransformer
from speedtronic.train.shapes import resolve_shape_profile, validate_startup_shapes


def _plan(mode: str, device_type: str) -> SimpleNamespace:
    """A PrecisionPlan look-alike (validate_startup_shapes only reads ``mode``)."""
    return SimpleNamespace(mode=mode, device_type=device_type)


def _config(micro=1, target=8, block=5, **shape) -> SpeedtronicConfig:
    return SpeedtronicConfig.from_dict(
        {
            "data": {"micro_batch_size": micro, "target_batch_size": target, "block_size": block},
            "model": {"vocab_size": 30, "max_seq_len": 8},
            "shape_validation": shape,
        }
    )


def _model(d_model=12) -> ReferenceTransformer:
    return ReferenceTransformer(vocab_size=30, block_size=8, n_layer=1, n_head=2, d_model=d_model)


class Recorder:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.events: list[tuple[str, dict]] = []

    def warning(self, message, *args):
        self.lines.append(message % args)

    def emit(self, event, payload):
        self.events.append((event, payload))


def test_profiles():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_shape_profile(cpu, _plan("bf16", "cpu")).alignment is None
    assert resolve_shape_profile(cuda, _plan("bf16", "cuda")).alignment == 8
    assert resolve_shape_profile(cuda, "fp16").source == "cuda-mixed-precision"
    assert resolve_shape_profile(cuda, _plan("fp32", "cuda")).alignment is None
    assert resolve_shape_profile(cuda, "bf16", requested_alignment="none").alignment is None
    assert resolve_shape_profile(cpu, "fp32", requested_alignment=16).alignment == 16
    assert resolve_shape_profile(cpu, "fp32", requested_alignment=None).alignment is None
    for bad in (0, -8, "eight", True):
        with pytest.raises(ValueError):
            resolve_shape_profile(cpu, "fp32", requested_alignment=bad)


def test_cpu_auto_is_quiet_but_explicit_alignment_warns():
    quiet = validate_startup_shapes(_config(), _model(), "cpu", _plan("bf16", "cpu"))
    assert quiet.warning_count == 0 and quiet.profile.alignment is None
    report = validate_startup_shapes(
        _config(alignment=8, warn_on_cpu=True), _model(), "cpu", _plan("fp32", "cpu")
    )
    codes = report.codes()
    assert {"batch_alignment", "sequence_alignment", "model_alignment"} <= codes
    assert all(w.suggested is not None for w in report.warnings)
    batch = next(w for w in report.warnings if w.code == "batch_alignment")
    assert batch.suggested == 8 and batch.field == "data.micro_batch_size"
    assert next(w for w in report.warnings if w.code == "sequence_alignment").suggested == 8
    without_opt_in = validate_startup_shapes(_config(alignment=8), _model(), "cpu", "fp32")
    assert without_opt_in.warning_count == 0 and without_opt_in.profile.alignment == 8


def test_batch_suggestion_divides_the_target_or_is_none():
    cfg = _config(micro=3, target=9, block=8, alignment=8, warn_on_cpu=True)
    report = validate_startup_shapes(cfg, _model(16), "cpu", "fp32")
    batch = next(w for w in report.warnings if w.code == "batch_alignment")
    assert batch.suggested is None
    cfg = _config(micro=9, target=72, block=8, alignment=8, warn_on_cpu=True)
    batch = next(
        w
        for w in validate_startup_shapes(cfg, _model(16), "cpu", "fp32").warnings
        if w.code == "batch_alignment"
    )
    assert batch.suggested == 8 and 72 % batch.suggested == 0


def test_cuda_auto_and_none_and_vocab_check():
    plan = _plan("bf16", "cuda")
    report = validate_startup_shapes(_config(), _model(), "cuda", plan)
    assert report.profile.alignment == 8 and report.warning_count > 0
    assert "vocab_alignment" not in report.codes()  # check_vocab is off by default
    assert "lm_head.out_features" not in [w.field for w in report.warnings]
    assert (
        validate_startup_shapes(_config(alignment="none"), _model(), "cuda", plan).warning_count
        == 0
    )
    assert (
        validate_startup_shapes(_config(enabled=False), _model(), "cuda", plan).warning_count == 0
    )
    vocab = validate_startup_shapes(_config(check_vocab=True), _model(), "cuda", plan)
    vocab_warnings = [w for w in vocab.warnings if w.code == "vocab_alignment"]
    assert [(w.field, w.value, w.suggested) for w in vocab_warnings] == [
        ("model.vocab_size", 30, 32)
    ]
    assert "also 1 other" in vocab_warnings[0].reason  # lm_head.out_features, same value
    only_model = _config(check_batch=False, check_sequence=False)
    assert validate_startup_shapes(only_model, _model(), "cuda", plan).codes() == {
        "model_alignment"
    }


def test_report_is_deduplicated_repeatable_and_serialisable():
    cfg = _config(alignment=8, warn_on_cpu=True)
    first = validate_startup_shapes(cfg, _model(), "cpu", "fp32")
    second = validate_startup_shapes(cfg, _model(), "cpu", "fp32")
    assert first.as_dict() == second.as_dict()
    data = first.as_dict()
    assert data["profile"]["alignment"] == 8 and data["warning_count"] == len(data["warnings"])
    keys = [(w["code"], w["value"]) for w in data["warnings"]]
    assert len(keys) == len(set(keys))
    assert set(data["warnings"][0]) == {
        "code",
        "field",
        "value",
        "suggested",
        "alignment",
        "reason",
    }


def test_metadata_hook_replaces_introspection_and_broken_hook_falls_back():
    model = _model()
    model.speedtronic_shape_metadata = lambda: {"custom.width": 13}
    cfg = _config(alignment=8, warn_on_cpu=True, check_batch=False, check_sequence=False)
    report = validate_startup_shapes(cfg, model, "cpu", "fp32")
    assert [(w.field, w.value, w.suggested) for w in report.warnings] == [("custom.width", 13, 16)]

    def broken():
        raise RuntimeError("boom")

    model.speedtronic_shape_metadata = broken
    assert validate_startup_shapes(cfg, model, "cpu", "fp32").warning_count > 0


def test_logging_and_events():
    recorder = Recorder()
    cfg = _config(alignment=8, warn_on_cpu=True)
    report = validate_startup_shapes(cfg, _model(), "cpu", "fp32", logger=recorder)
    assert len(recorder.lines) == report.warning_count
    assert recorder.lines[0].startswith("shape warning: data.micro_batch_size=1 is not a multiple")
    names = [event for event, _ in recorder.events]
    assert names.count("shape_warning") == report.warning_count and names[-1] == "shape_profile"
    assert recorder.events[-1][1] == {
        "device_type": "cpu", "precision": "fp32", "alignment": 8,
        "warning_count": report.warning_count,
    }  # fmt: skip
    std = logging.getLogger("speedtronic.test.shapes")
    assert validate_startup_shapes(cfg, _model(), "cpu", "fp32", logger=std).warning_count > 0


def test_compat_module_exports():
    import speedtronic.shapes as compat

    assert compat.validate_startup_shapes is validate_startup_shapes
