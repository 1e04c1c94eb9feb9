"""Cautious updates over any optimizer with decoupled weight decay.

Liang, Chen, Liu, Liu, "Cautious Optimizers: Improving Training with One Line of Code" (2024,
arXiv 2411.16085, code ``kyleliang919/C-Optim``). For a base update ``u`` (the descent step the
base optimizer proposes) and gradient ``g``, per parameter tensor::

    φ = 1[u ⊙ g > 0]                       # keep coordinates where update and gradient agree
    θ ← θ·(1 − ηλ) − u ⊙ φ · numel(φ) / (Σφ + 1)

The rescale ``numel/(Σφ + 1)`` is the paper's (Algorithm 1 / C-AdamW): it keeps the mean step
size of the surviving coordinates close to the base step. Decoupled weight decay ``θ·(1 − ηλ)``
is applied unmasked, as in the paper. Speedtronic 2.0.0 instead masked the whole observed step
(decay included) and did not rescale; see docs/optimizers.md.

Implementation: a generic wrapper. It snapshots the parameters, lets the base optimizer step,
recovers ``u = θ_old·(1 − ηλ) − θ_new`` (exact for AdamW and Muon, whose decay is
``θ·(1 − ηλ)`` applied first) and rewrites the parameter. Optimizer state advances as in the
base; no extra state is stored, so checkpoints are exactly the base's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

import torch
from torch import Tensor
from torch.optim import Optimizer

from speedtronic.json_types import StateDict
from speedtronic.optim.muon import closure_loss


def cautious_mask(update: Tensor, grad: Tensor) -> Tensor:
    """Rescaled cautious mask ``φ · numel(φ) / (Σφ + 1)`` with ``φ = 1[update ⊙ grad > 0]``.

    ``update`` is the descent step (``θ_new = θ_old − update``); returns a float tensor of the
    update's shape (dimensionless).
    """
    keep = (update * grad.to(update.dtype)) > 0
    mask = keep.to(update.dtype)
    return mask.mul_(mask.numel() / (mask.sum() + 1.0))


def cautious_step(
    old: Tensor, new: Tensor, grad: Tensor, *, lr: float, weight_decay: float
) -> Tensor:
    """Return the cautious replacement for ``new`` given the base step ``old -> new``.

    ``lr`` and ``weight_decay`` are the group's values (decoupled decay ``θ·(1 − lr·wd)``).
    Pure: the inputs are not modified.
    """
    decayed = old * (1.0 - lr * weight_decay) if weight_decay else old
    update = decayed - new
    return decayed - update * cautious_mask(update, grad)


class CautiousOptimizer(Optimizer):
    """Cautious facade over ``base`` (AdamW, Muon, HybridOptimizer, ...).

    ``param_groups``, ``defaults`` and ``state`` are the base's objects, so schedulers and
    ``state.clear()`` act on the base. ``state_dict``/``load_state_dict``/``zero_grad``/
    ``add_param_group`` delegate to it. GradScaler unscales before ``step`` (the wrapper does
    not handle scaling itself). Cost: one copy of the stepped parameters per step.
    """

    def __init__(self, base: Optimizer) -> None:
        if isinstance(base, CautiousOptimizer):
            raise ValueError("optimizer is already cautious")
        self.base = base
        self._ready = False
        super().__init__(base.param_groups, base.defaults)
        self._ready = True
        self._alias()
        self._step_supports_amp_scaling = False

    def _alias(self) -> None:
        self.param_groups = self.base.param_groups
        self.defaults = self.base.defaults
        self.state = self.base.state

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Evaluate ``closure`` once, step the base, then apply the cautious mask."""
        loss = closure_loss(closure)
        snapshot: list[tuple[Tensor, Tensor, Tensor, float, float]] = []
        for group in self.param_groups:
            lr, decay = float(group["lr"]), float(group.get("weight_decay", 0.0))
            for param in group["params"]:
                grad = param.grad
                if grad is not None and not grad.is_sparse:
                    snapshot.append((param, grad, param.detach().clone(), lr, decay))
        self.base.step()
        for param, grad, old, lr, decay in snapshot:
            # cautious_step, in place on the snapshot (fewer temporaries).
            if decay:
                old.mul_(1.0 - lr * decay)
            update = old - param
            param.copy_(old.sub_(update.mul_(cautious_mask(update, grad))))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Delegate to the base optimizer."""
        self.base.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> StateDict:
        """The base optimizer's state dict (no cautious-specific entries)."""
        return self.base.state_dict()

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load into the base, then re-alias groups, defaults and state."""
        self.base.load_state_dict(state_dict)
        self._alias()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Delegate to the base (during ``__init__`` the groups are already the base's)."""
        if not self.__dict__.get("_ready", False):
            return
        self.base.add_param_group(param_group)
        self._alias()

    def __repr__(self) -> str:
        return f"CautiousOptimizer({self.base!r})"
