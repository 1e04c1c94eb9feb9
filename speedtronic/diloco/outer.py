"""The outer optimizer of DiLoCo: SGD with Nesterov momentum on the averaged pseudo-gradient.

Pure tensor math; the master's round (:mod:`speedtronic.diloco.master`) calls it once per
closed round.
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
    if g32.is_complex():
        g32 = g32.real
    buf.mul_(momentum).add_(g32)
    effective = buf.mul(momentum).add_(g32)  # g + momentum * buf, one temporary
    if weight.dtype == torch.float32:
        weight.add_(effective, alpha=-lr)
    else:
        weight.sub_((lr * effective).to(weight.dtype))


class NesterovOuterOptimizer:
    """Float32 CPU momentum buffers for every floating key of ``state``; ``step`` is in place."""

    def __init__(self, state: Mapping[str, torch.Tensor], lr: float, momentum: float = 0.9):
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.momentum_buffers: dict[str, torch.Tensor] = {
            k: torch.zeros(tuple(v.shape), dtype=torch.float32)
            for k, v in state.items()
            if v.is_floating_point() or v.is_complex()
        }

    @torch.no_grad()
    def step(self, state: dict[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> None:
        """Apply the averaged pseudo-gradient ``delta`` to ``state`` in place."""
        for key, grad in delta.items():
            if key not in state:
                raise KeyError(key)
            weight = state[key]
            if tuple(weight.shape) != tuple(grad.shape):
                raise ValueError(f"shape mismatch for {key}")
            if not (weight.is_floating_point() or weight.is_complex()):
                continue
            buf = self.momentum_buffers.setdefault(
                key, torch.zeros(tuple(weight.shape), dtype=torch.float32)
            )
            nesterov_update(weight, grad, buf, lr=self.lr, momentum=self.momentum)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU clones of the momentum buffers."""
        return {k: v.detach().clone() for k, v in self.momentum_buffers.items()}

    def load_state_dict(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """Replace every buffer with a float32 CPU clone."""
        self.momentum_buffers = {
            str(k): v.detach().to("cpu", torch.float32).clone() for k, v in buffers.items()
        }
