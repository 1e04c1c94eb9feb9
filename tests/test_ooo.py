"""Out-of-order backprop scheduler: stage discovery, disabled paths, CUDA equivalence.

tests/conftest.py hides GPUs by default; run the CUDA tests with
``CUDA_VISIBLE_DEVICES=0 pytest tests/test_ooo.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from speedtronic.model import ReferenceTransformer
from speedtronic.train.ooo import StageStreamScheduler, select_stages


class TwoBranch(nn.Module):
    """Two independent branches joined at the end (the case OOO can overlap)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.left = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.right = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.left(x) + self.right(x)).square().mean()


class Recorder:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, message, *args):
        self.lines.append(message % args if args else message)


def test_leaf_stage_discovery_dedups_shared_modules():
    model = TwoBranch()
    model.shared = model.head  # same module under two names
    names = [name for name, _ in select_stages(model)]
    assert names == [
        "left.0", "left.1", "left.2", "right.0", "right.1", "right.2", "head"
    ]  # fmt: skip


def test_named_stages_are_validated():
    model = TwoBranch()
    model.ooo_stage_names = ["left", "right", "missing", ""]
    assert [name for name, _ in select_stages(model)] == ["left", "right"]
    model.ooo_stage_names = ["left", "left"]
    with pytest.raises(ValueError, match="duplicate"):
        select_stages(model)
    model.ooo_stage_names = ["left", "left.0"]
    with pytest.raises(ValueError, match="nested"):
        select_stages(model)
    model.ooo_stage_names = ["missing"]  # nothing valid -> leaf discovery
    assert len(select_stages(model)) == 7


def test_reference_model_stage_discovery():
    model = ReferenceTransformer(vocab_size=32, block_size=8, n_layer=2, n_head=4, d_model=32)
    names = [name for name, _ in select_stages(model)]
    assert "transformer.h.1.attn.q_proj" in names and "lm_head" in names
    assert len(names) == len(set(names))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_non_cuda_devices_are_disabled_no_ops(device):
    scheduler = StageStreamScheduler(TwoBranch(), device, num_streams=2)
    assert scheduler.enabled is False and device in scheduler.reason
    scheduler.begin()
    scheduler.finish()
    scheduler.dispose()
    scheduler.dispose()
    assert scheduler.as_dict() == {
        "enabled": False, "reason": scheduler.reason, "streams": 0, "stages": []
    }  # fmt: skip


def test_cpu_forward_and_backward_are_unchanged():
    torch.manual_seed(0)
    model = TwoBranch(8)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    scheduler = StageStreamScheduler(model, "cpu")
    scheduler.begin()
    try:
        loss = model(x)
    finally:
        scheduler.finish()
    loss.backward()
    reference(x).backward()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_requested_without_cuda_reports_reason_and_bad_names_degrade():
    scheduler = StageStreamScheduler(TwoBranch(), "cuda", num_streams=99)
    assert scheduler.enabled is False and scheduler.reason == "CUDA is unavailable"
    assert scheduler.requested_streams == 8
    model = TwoBranch()
    model.ooo_stage_names = ["left", "left.0"]
    recorder = Recorder()
    degraded = StageStreamScheduler(model, "cuda", logger=recorder)
    assert degraded.enabled is False
    assert degraded.reason.startswith("stream scheduling setup failed: nested")
    assert recorder.lines == [f"ooo_backprop disabled: {degraded.reason}"]
    single = nn.Linear(2, 2)
    few = StageStreamScheduler(single, "cuda")
    assert few.enabled is False and "fewer than two" in few.reason


def test_disabled_null_object():
    scheduler = StageStreamScheduler.disabled("compile is enabled")
    assert scheduler.as_dict()["reason"] == "compile is enabled"
    scheduler.begin()
    scheduler.finish()


def test_compat_module_exports():
    import speedtronic.scheduling as compat

    assert compat.StageStreamScheduler is StageStreamScheduler


def _grads_and_losses(model: nn.Module, batches, scheduler: StageStreamScheduler | None):
    losses = []
    model.zero_grad(set_to_none=True)
    for x in batches:
        if scheduler is not None:
            scheduler.begin()
        try:
            loss = model(x)
        finally:
            if scheduler is not None:
                scheduler.finish()
        loss.backward()
        losses.append(loss.item())
    torch.cuda.synchronize()
    return losses, [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("streams", [1, 2, 4])
def test_cuda_losses_and_grads_match_with_and_without_ooo(streams):
    torch.manual_seed(0)
    device = torch.device("cuda")
    base = TwoBranch(256).to(device)
    batches = [torch.randn(64, 256, device=device) for _ in range(3)]
    plain_model = copy.deepcopy(base)
    expected_losses, expected_grads = _grads_and_losses(plain_model, batches, None)
    ooo_model = copy.deepcopy(base)
    scheduler = StageStreamScheduler(ooo_model, device, num_streams=streams)
    assert scheduler.enabled, scheduler.reason
    assert scheduler.as_dict()["streams"] == min(streams, 7)
    try:
        losses, grads = _grads_and_losses(ooo_model, batches, scheduler)
    finally:
        scheduler.dispose()
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_reference_transformer_matches_under_bf16_autocast():
    torch.manual_seed(0)
    device = torch.device("cuda")
    base = ReferenceTransformer(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=64)
    base = base.to(device)
    ids = torch.randint(0, 64, (4, 16), device=device)

    def run(model, scheduler):
        if scheduler is not None:
            scheduler.begin()
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, labels=ids)["loss"]
        finally:
            if scheduler is not None:
                scheduler.finish()
        loss.backward()
        torch.cuda.synchronize()
        return loss.item(), [p.grad.float() for p in model.parameters()]

    want_loss, want = run(copy.deepcopy(base), None)
    ooo = copy.deepcopy(base)
    scheduler = StageStreamScheduler(ooo, device, num_streams=4)
    assert scheduler.enabled, scheduler.reason
    got_loss, got = run(ooo, scheduler)
    scheduler.dispose()
    assert got_loss == pytest.approx(want_loss, rel=1e-3)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-4)
