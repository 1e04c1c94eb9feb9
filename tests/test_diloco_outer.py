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


def _ours_and_torch(shape: tuple[int, ...]):
    """One random weight of ``shape`` twice: ours (``{"w": ...}`` and its Nesterov outer
    optimizer) and torch's (a Parameter and ``SGD(nesterov=True)``), lr 0.7, momentum 0.9."""
    weight = torch.randn(*shape)
    ours = {"w": weight.clone()}
    opt = NesterovOuterOptimizer(ours, lr=0.7, momentum=0.9)
    param = torch.nn.Parameter(weight.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    return ours, opt, param, sgd


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
    ours, opt, param, sgd = _ours_and_torch((4, 3))
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
    from speedtronic.diloco import ledger

    torch.manual_seed(0)
    weight = torch.randn(16, 9).to(dtype)
    ours = {"w": weight.clone(), "n": torch.tensor(3)}
    opt = NesterovOuterOptimizer(ours, lr=0.7, momentum=momentum)
    sgd = opt.sgd
    ref, buf = weight.clone(), torch.zeros(16, 9)
    steps = []
    real_update = ledger.sgd_update

    def counted(*args, **kwargs):
        steps.append(kwargs["nesterov"])
        return real_update(*args, **kwargs)

    monkeypatch.setattr(ledger, "sgd_update", counted)
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


def test_a_tensor_of_many_slices_steps_as_one_torch_sgd_over_the_whole_tensor(monkeypatch):
    """Slices are an implementation detail: a tensor larger than a slice (and not a multiple
    of it) gets the numbers of one torch SGD-Nesterov over the whole tensor, step after step."""
    from speedtronic.diloco import ledger

    monkeypatch.setattr(ledger, "OUTER_CHUNK", 7)
    torch.manual_seed(1)
    ours, opt, param, sgd = _ours_and_torch((5, 9))
    for _ in range(4):
        grad = torch.randn(5, 9)
        assert opt.first_non_finite(ours, {"w": grad}) is None
        opt.step(ours, {"w": grad})
        param.grad = grad.clone()
        sgd.step()
    torch.testing.assert_close(ours["w"], param.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        opt.momentum_buffers()["w"], sgd.state[param]["momentum_buffer"], rtol=1e-6, atol=1e-6
    )


def test_the_state_dict_carries_the_momentum_to_a_new_optimizer_over_new_tensors():
    """A restart: the state_dict (torch's, or the by-name buffers of an outer state file) loaded
    into the optimizer of another process over other tensors continues the same run."""
    torch.manual_seed(2)
    grads = [torch.randn(3, 4) for _ in range(4)]
    whole = {"w": torch.randn(3, 4)}
    first = {"w": whole["w"].clone()}
    opt = NesterovOuterOptimizer(whole, lr=0.5, momentum=0.9)
    for grad in grads:
        opt.step(whole, {"w": grad})
    half = NesterovOuterOptimizer(first, lr=0.5, momentum=0.9)
    for grad in grads[:2]:
        half.step(first, {"w": grad})
    for saved in (half.state_dict(), {k: v.clone() for k, v in half.momentum_buffers().items()}):
        again = {"w": first["w"].clone()}  # new tensors: the optimizer binds to them
        resumed = NesterovOuterOptimizer(again, lr=0.5, momentum=0.9)
        resumed.load_state_dict(saved)
        for grad in grads[2:]:
            resumed.step(again, {"w": grad})
        assert torch.equal(again["w"], whole["w"])
    with pytest.raises(ValueError, match="reshaped"):
        resumed.load_state_dict({"w": torch.zeros(4, 3)})


def test_a_failed_trial_changes_neither_the_weights_nor_the_momentum():
    """The non-finite check runs the same update on copies: nothing of the step is kept."""
    state = {"w": torch.tensor([3.0e38, 1.0])}
    opt = NesterovOuterOptimizer(state, lr=1.0, momentum=0.9)
    opt.step(state, {"w": torch.tensor([0.0, 0.5])})
    before = (state["w"].clone(), opt.momentum_buffers()["w"].clone())
    assert opt.first_non_finite(state, {"w": torch.tensor([-3.0e38, 0.0])}) == "w"
    assert torch.equal(state["w"], before[0])
    assert torch.equal(opt.momentum_buffers()["w"], before[1])
