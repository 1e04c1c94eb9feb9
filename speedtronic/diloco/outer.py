"""The outer optimizer of DiLoCo: ``torch.optim.SGD`` on the averaged pseudo-gradient.

DiLoCo (Douillard et al. 2023, Algorithm 1) applies the round's mean pseudo-gradient
``Δ = mean(global - local)`` to the global weights with SGD and Nesterov momentum::

    buf    = momentum * buf + Δ
    global = global - lr * (Δ + momentum * buf)        (plain SGD when momentum == 0)

:class:`NesterovOuterOptimizer` is a thin shell over ``torch.optim.SGD(nesterov=True)``: the
global's floating tensors are float32 CPU parameters, the pseudo-gradient is their ``.grad``,
and the momentum buffers are kept by tensor name (so a saved outer state loads into any
process). :func:`nesterov_update` is the same rule written out by hand for one tensor (the
golden the SGD shell is tested against, and 2.0.0 public API).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["NesterovOuterOptimizer", "nesterov_update"]


def nesterov_update(
    weight: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, *, lr: float, momentum: float
) -> None:
    """One SGD-Nesterov step with the pseudo-gradient as gradient (DiLoCo, Douillard et al. 2023).

    In place: ``buf = momentum*buf + g``; ``weight -= lr*(g + momentum*buf)``. Computed in
    float32, applied in the weight's dtype. From zero momentum the first step is
    ``weight - lr*(1+momentum)*g`` (1.9·g at μ=0.9).
    """
    g32 = grad.to(device=weight.device, dtype=torch.float32)
    buf.mul_(momentum).add_(g32)
    effective = buf.mul(momentum).add_(g32)  # g + momentum * buf, one temporary
    if weight.dtype == torch.float32:
        weight.add_(effective, alpha=-lr)
    else:
        weight.sub_((lr * effective).to(weight.dtype))


class NesterovOuterOptimizer:
    """The outer step: ``torch.optim.SGD`` (Nesterov when ``momentum > 0``) over the floating
    tensors of a state dict, with float32 CPU momentum buffers kept by tensor name.

    ``lr`` is the outer learning rate (DiLoCo's 0.7), ``momentum`` its Nesterov momentum (0.9;
    0 is plain SGD). ``step(state, delta)`` updates ``state`` in place.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], lr: float, momentum: float = 0.9):
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.momentum_buffers: dict[str, torch.Tensor] = {
            k: torch.zeros(tuple(v.shape), dtype=torch.float32)
            for k, v in state.items()
            if v.is_floating_point()
        }

    @torch.no_grad()
    def step(self, state: dict[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> None:
        """Apply the averaged pseudo-gradient ``delta`` to ``state`` in place (``KeyError`` for
        a key ``state`` lacks, ``ValueError`` for a shape that differs)."""
        keys: list[str] = []
        params: list[torch.Tensor] = []
        for key, grad in delta.items():
            if key not in state:
                raise KeyError(key)
            weight = state[key]
            if tuple(weight.shape) != tuple(grad.shape):
                raise ValueError(f"shape mismatch for {key}")
            if not weight.is_floating_point():
                continue
            native = weight.dtype == torch.float32 and weight.device.type == "cpu"
            param = weight if native else weight.detach().to("cpu", torch.float32)
            param.grad = grad.detach().to("cpu", torch.float32)
            keys.append(key)
            params.append(param)
        if not params:
            return
        nesterov = self.momentum > 0
        sgd = torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=nesterov)
        if nesterov:
            for key, param in zip(keys, params, strict=True):
                buf = self.momentum_buffers.get(key)
                if buf is not None:
                    sgd.state[param]["momentum_buffer"] = buf
        sgd.step()
        for key, param in zip(keys, params, strict=True):
            if nesterov:
                self.momentum_buffers[key] = sgd.state[param]["momentum_buffer"]
            param.grad = None
            if param is not state[key]:
                state[key].copy_(param)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU clones of the momentum buffers, by tensor name."""
        return {k: v.detach().clone() for k, v in self.momentum_buffers.items()}

    def load_state_dict(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """Replace every buffer with a float32 CPU clone of ``buffers`` (by tensor name)."""
        self.momentum_buffers = {
            str(k): v.detach().to("cpu", torch.float32).clone() for k, v in buffers.items()
        }
