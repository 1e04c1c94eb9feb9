"""The outer optimizer: Nesterov goldens (the master's round is tested in test_diloco_master.py)."""

from __future__ import annotations

import pytest
import torch

from speedtronic.diloco.master import NesterovOuterOptimizer, nesterov_update


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


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sgd_shell_gives_the_numbers_of_nesterov_update(momentum, dtype):
    """Golden: the outer step is torch.optim.SGD (Nesterov when momentum > 0) and gives the
    numbers of the hand-written rule over several steps (float32 rounding apart; a bf16
    weight is updated in float32 and rounded once, where the hand rule rounds the step)."""
    torch.manual_seed(0)
    weight = torch.randn(16, 9).to(dtype)
    ours = {"w": weight.clone(), "n": torch.tensor(3)}
    opt = NesterovOuterOptimizer(ours, lr=0.7, momentum=momentum)
    ref, buf = weight.clone(), torch.zeros(16, 9)
    steps = []
    real_step = torch.optim.SGD.step

    def counted(self, *args, **kwargs):
        steps.append(self.defaults["nesterov"])
        return real_step(self, *args, **kwargs)

    torch.optim.SGD.step = counted
    try:
        for _ in range(6):
            grad = torch.randn(16, 9)
            opt.step(ours, {"w": grad})
            nesterov_update(ref, grad, buf, lr=0.7, momentum=momentum)
    finally:
        torch.optim.SGD.step = real_step
    assert steps == [momentum > 0] * 6  # one torch SGD step per outer step
    assert ours["w"].dtype == dtype and ours["n"].item() == 3
    if dtype == torch.float32 and momentum == 0.0:
        assert torch.equal(ours["w"], ref)
    elif dtype == torch.float32:
        torch.testing.assert_close(ours["w"], ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.state_dict()["w"], buf, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(ours["w"], ref, rtol=2e-2, atol=2e-2)  # bf16 rounding
