"""The outer optimizer: Nesterov goldens (the master's round is tested in test_diloco_master.py)."""

from __future__ import annotations

import pytest
import torch

from speedtronic.diloco.outer import NesterovOuterOptimizer


def test_nesterov_first_step_golden():
    state = {"w": torch.tensor([1.0, 1.0])}
    opt = NesterovOuterOptimizer(state, lr=1.0, momentum=0.9)
    opt.step(state, {"w": torch.tensor([0.1, 0.2])})
    assert torch.allclose(state["w"], torch.tensor([0.81, 0.62]))  # w - 1.9 g
    state2 = {"w": torch.tensor([1.0, 1.0])}
    opt2 = NesterovOuterOptimizer(state2, lr=0.1, momentum=0.9)
    opt2.step(state2, {"w": torch.tensor([1.0, 2.0])})
    assert torch.allclose(state2["w"], torch.tensor([0.81, 0.62]))
    opt2.step(state2, {"w": torch.tensor([1.0, 2.0])})
    assert state2["w"].shape == (2,)
    # second step: buf = 0.9*g + g = 1.9g; effective = g + 0.9*1.9g = 2.71g
    assert torch.allclose(state2["w"], torch.tensor([0.81 - 0.271, 0.62 - 0.542]))
    with pytest.raises(KeyError):
        opt.step(state, {"x": torch.ones(2)})


def test_nesterov_matches_torch_sgd_nesterov():
    """Same arithmetic as torch.optim.SGD(nesterov=True) with the pseudo-gradient as .grad."""
    torch.manual_seed(0)
    weight = torch.randn(4, 3)
    ours = {"w": weight.clone()}
    opt = NesterovOuterOptimizer(ours, lr=0.7, momentum=0.9)
    param = torch.nn.Parameter(weight.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(5):
        grad = torch.randn(4, 3)
        opt.step(ours, {"w": grad})
        param.grad = grad.clone()
        sgd.step()
    assert torch.allclose(ours["w"], param.detach(), atol=1e-6)
