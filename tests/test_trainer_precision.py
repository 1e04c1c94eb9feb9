"""Device and precision resolution (CPU-checkable rows of the fallback table)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from speedtronic.optim import supports_fused_adamw
from speedtronic.train.precision import (
    autocast_context,
    make_grad_scaler,
    parameter_count,
    resolve_device,
    resolve_precision,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("request_", "mode", "autocast"),
    [
        ("auto", "fp32", False),
        ("fp32", "fp32", False),
        ("fp16", "fp32", False),
        ("bf16", "bf16", True),
    ],
)
def test_cpu_precision_table(request_, mode, autocast):
    plan = resolve_precision(SimpleNamespace(mode=request_, dtype=None), CPU)
    assert (plan.mode, plan.autocast_enabled, plan.use_scaler) == (mode, autocast, False)
    assert make_grad_scaler(plan) is None


def test_string_and_dtype_forms():
    assert resolve_precision("bf16", CPU).dtype == torch.bfloat16
    assert resolve_precision(None, CPU).mode == "fp32"
    assert resolve_precision(SimpleNamespace(mode="auto", dtype="bfloat16"), CPU).mode == "bf16"
    with pytest.raises(ValueError, match=r"precision\.mode"):
        resolve_precision("fp8", CPU)


def test_cuda_plan_without_cuda_falls_back_in_autocast_only():
    plan = resolve_precision("bf16", CPU)
    with autocast_context(plan):
        out = torch.ones(2, 2) @ torch.ones(2, 2)
    assert out.dtype == torch.bfloat16
    with autocast_context(resolve_precision("fp32", CPU)):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_devices():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto").type in {"cpu", "cuda", "mps"}
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA was requested but is not available"):
            resolve_device("cuda")
        assert supports_fused_adamw("cuda") is False
    assert supports_fused_adamw(CPU) is False


def test_parameter_count_counts_tied_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    assert parameter_count(torch.nn.ModuleList([emb, head])) == 40
