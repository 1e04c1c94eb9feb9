"""The outer optimizer: Nesterov goldens (the master's round is tested in test_diloco_master.py)."""

from __future__ import annotations

import pytest
import torch

from speedtronic.diloco.master import NesterovOuterOptimizer


def nesterov_update(
    weight: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, *, lr: float, momentum: float
) -> None:
    """The golden: one SGD-Nesterov step written out (DiLoCo, Douillard et al. 2023), in place:
    ``buf = momentum*buf + g``; ``weight -= lr*(g + momentum*buf)``, computed in float32 and
    applied in the weight's dtype."""
    g32 = grad.to(device=weight.device, dtype=torch.float32)
    buf.mul_(momentum).add_(g32)
    effective = buf.mul(momentum).add_(g32)
    if weight.dtype == torch.float32:
        weight.add_(effective, alpha=-lr)
    else:
        weight.sub_((lr * effective).to(weight.dtype))


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
def test_the_sgd_shell_gives_the_numbers_of_nesterov_update(momentum, dtype, monkeypatch):
    """Golden: the outer step is one torch.optim.SGD (Nesterov when momentum > 0) made once,
    whose update (torch's functional SGD, slice by slice) gives the numbers of the hand-written
    rule over several steps (float32 rounding apart; a bf16 weight is updated in float32 and
    rounded once, where the hand rule rounds the step)."""
    from speedtronic.diloco import master

    torch.manual_seed(0)
    weight = torch.randn(16, 9).to(dtype)
    ours = {"w": weight.clone(), "n": torch.tensor(3)}
    opt = NesterovOuterOptimizer(ours, lr=0.7, momentum=momentum)
    sgd = opt.sgd
    ref, buf = weight.clone(), torch.zeros(16, 9)
    steps = []
    real_update = master.sgd_update

    def counted(*args, **kwargs):
        steps.append(kwargs["nesterov"])
        return real_update(*args, **kwargs)

    monkeypatch.setattr(master, "sgd_update", counted)
    for _ in range(6):
        grad = torch.randn(16, 9)
        opt.step(ours, {"w": grad})
        nesterov_update(ref, grad, buf, lr=0.7, momentum=momentum)
    assert steps == [momentum > 0] * 6  # one torch SGD update per outer step (one slice)
    assert opt.sgd is sgd and isinstance(sgd, torch.optim.SGD)
    assert sgd.param_groups[0]["param_names"] == ["w"]  # the floating tensors only
    assert ours["w"].dtype == dtype and ours["n"].item() == 3
    if dtype == torch.float32 and momentum == 0.0:
        assert torch.equal(ours["w"], ref)
    elif dtype == torch.float32:
        torch.testing.assert_close(ours["w"], ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.momentum_buffers()["w"], buf, rtol=1e-6, atol=1e-6)
        saved = opt.state_dict()  # torch's: by parameter index, the names in its group
        torch.testing.assert_close(saved["state"][0]["momentum_buffer"], buf, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(ours["w"], ref, rtol=2e-2, atol=2e-2)  # bf16 rounding
