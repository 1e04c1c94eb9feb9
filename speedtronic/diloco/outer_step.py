"""The outer step's arithmetic beyond SGD: adaptive extrapolation, the final average, and the
inner optimizer's first moment averaged across nodes (issue 33; ``distributed.outer_step``,
``final_average``, ``sync_inner_momentum``).

Adaptive extrapolation (FedExP, Jhunjhunwala et al., ICLR 2023). A round's contributions
``d_j`` with weights ``w_j`` (1 a file; a relay leader's file counts for its group) give::

    mean    = sum_j w_j d_j / W                     W = sum_j w_j
    spread  = sum_j w_j ||d_j||^2 / W               the mean squared norm of a contribution
    eta     = min(cap, max(1, c * spread / ||mean||^2))
    global  = global - eta * mean                   (SGD, lr eta, no momentum)

Identical contributions give ``spread == ||mean||^2`` (eta 1 for c <= 1); K orthogonal ones of
equal norm give ``K``. :class:`NormTally` collects ``spread`` while the contributions are
summed, a slice at a time, so the master's memory stays one running sum; ``||mean||^2`` is
read from that sum afterwards (:func:`squared_norm`). Sums of squares are float64, and eta is
rounded to :data:`ETA_DIGITS` decimals, so the order in which slices were added (a file read
in chunks, the ideal's whole tensors) cannot change it: the master, a restarted master and
:func:`speedtronic.testing.diloco_ideal.simulate` agree on it exactly.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import torch

__all__ = [
    "ETA_DIGITS",
    "NormTally",
    "RecentGlobals",
    "adaptive_eta",
    "average_states",
    "first_moments",
    "install_first_moments",
    "squared_norm",
    "syncs_momentum",
]

#: eta is rounded to this many decimals (see the module docstring).
ETA_DIGITS = 6


def _sq(value: torch.Tensor) -> float:
    """``||value||^2`` in float64 (a float32 value's square is exact in float64)."""
    return float(value.detach().to(torch.float64).pow(2).sum())


class NormTally:
    """``sum_j w_j ||d_j||^2`` and ``sum_j w_j`` over a round's contributions, fed slice by slice.

    Call :meth:`add` with every decoded slice of contribution ``j`` (any partition of its
    values, in any order) and its weight, then :meth:`close` once per contribution with the
    same weight. :attr:`count` is the number of contributions closed.
    """

    def __init__(self) -> None:
        self.weighted_sq = 0.0
        self.weight = 0.0
        self.count = 0

    def add(self, part: torch.Tensor, weight: float = 1.0) -> None:
        """Add ``weight * ||part||^2`` (one slice of the contribution being read)."""
        self.weighted_sq += weight * _sq(part)

    def close(self, weight: float = 1.0) -> None:
        """One contribution of ``weight`` is complete."""
        self.weight += weight
        self.count += 1

    @property
    def spread(self) -> float:
        """``sum_j w_j ||d_j||^2 / W`` (0.0 before any contribution)."""
        return self.weighted_sq / self.weight if self.weight > 0 else 0.0


def squared_norm(state: Mapping[str, torch.Tensor], chunk: int = 1 << 18) -> float:
    """``||state||^2`` over every floating tensor, in float64, ``chunk`` values at a time (the
    temporaries stay one chunk however large a tensor is)."""
    total = 0.0
    for key in sorted(state):
        value = state[key]
        if not value.is_floating_point():
            continue
        flat = value.detach().reshape(-1)
        for start in range(0, flat.numel(), chunk):
            total += _sq(flat[start : start + chunk])
    return total


def adaptive_eta(spread: float, mean_sq_norm: float, count: int, c: float, cap: float) -> float:
    """The round's outer lr: ``min(cap, max(1, c * spread / mean_sq_norm))``, rounded.

    Degenerate rounds step with 1.0 (plain averaging): fewer than two contributions (the ratio
    of one contribution to itself says nothing about how the nodes disagree), a zero mean (the
    step is zero whatever eta is) or a ratio that is not finite.
    """
    if count < 2 or mean_sq_norm <= 0.0:
        return 1.0
    ratio = c * spread / mean_sq_norm
    if not math.isfinite(ratio):
        return 1.0
    return round(min(cap, max(1.0, ratio)), ETA_DIGITS)


def average_states(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The mean of ``states`` key by key: summed in float32 in the given order, divided by
    their number, cast back to the first state's dtypes; non-floating values (counters) are
    the last state's."""
    if not states:
        raise ValueError("nothing to average")
    last = states[-1]
    result: dict[str, torch.Tensor] = {}
    for key, value in states[0].items():
        if not value.is_floating_point():
            result[key] = last[key].clone()
            continue
        total = value.detach().to("cpu", torch.float32, copy=True)
        for state in states[1:]:
            total.add_(state[key].detach().to("cpu", torch.float32))
        result[key] = total.div_(float(len(states))).to(value.dtype)
    return result


class RecentGlobals:
    """The last ``n`` globals, for ``distributed.final_average``: :meth:`push` each global as it
    is made (global 0 included), :meth:`final` gives the mean of those held (fewer than ``n``
    before ``n`` rounds). Holds ``n - 1`` copies besides the caller's (none for ``n == 1``)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError("final_average must be >= 1")
        self.n = n
        self._held: deque[dict[str, torch.Tensor]] = deque(maxlen=n - 1)
        self._last: Mapping[str, torch.Tensor] | None = None

    def push(self, state: Mapping[str, torch.Tensor]) -> None:
        """Record the newest global (copied when it is not the last one kept)."""
        if self._last is not None and self.n > 1:
            self._held.append({k: v.detach().clone() for k, v in self._last.items()})
        self._last = {k: v.detach().clone() for k, v in state.items()} if self.n > 1 else state

    def final(self) -> dict[str, torch.Tensor]:
        """The mean of the held globals, oldest first; the last global itself when n == 1."""
        if self._last is None:
            raise ValueError("no global pushed")
        if self.n == 1:
            return {k: v.detach().clone() for k, v in self._last.items()}
        return average_states([*self._held, self._last])


def syncs_momentum(mode: str, every: int, outer_step: int) -> bool:
    """Whether the round that makes global ``outer_step`` (1, 2, ...) averages the inner first
    moment: never (``off``), every round, or every ``every``-th (``every_n``)."""
    if mode == "off":
        return False
    return mode == "every_round" or outer_step % every == 0


def _named_params(model: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Parameter]]:
    return ((name, p) for name, p in model.named_parameters() if p.requires_grad)


def first_moments(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """The inner optimizer's first moment (AdamW ``exp_avg``) by parameter name, float32 CPU
    copies; parameters without one yet (no step taken) are absent."""
    result: dict[str, torch.Tensor] = {}
    for name, param in _named_params(model):
        moment = optimizer.state.get(param, {}).get("exp_avg")
        if isinstance(moment, torch.Tensor):
            result[name] = moment.detach().to("cpu", torch.float32, copy=True)
    return result


@torch.no_grad()
def install_first_moments(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, moments: Mapping[str, torch.Tensor]
) -> int:
    """Copy ``moments`` into the optimizer's ``exp_avg`` of the parameters of the same names
    (in their dtype and device); returns how many were installed. A parameter the optimizer
    holds no first moment for is left alone (its state starts at its first step)."""
    installed = 0
    for name, param in _named_params(model):
        moment = optimizer.state.get(param, {}).get("exp_avg")
        if name in moments and isinstance(moment, torch.Tensor):
            moment.copy_(moments[name].to(moment.device, moment.dtype))
            installed += 1
    return installed
