"""Learning-rate schedules: linear warmup, then cosine decay to ``min_lr_ratio`` or constant.

The factor for scheduler position ``s`` (completed optimizer updates; ``LambdaLR.last_epoch``)
with ``W = max(0, warmup_steps)``, ``T = max(1, max_steps)``, ``ρ = min_lr_ratio``::

    s < W (W > 0):  max(1e-8, (s + 1) / W)
    constant:       1
    cosine:         ρ + (1 − ρ)·½·(1 + cos(π·clamp((s − W) / max(1, T − W), 0, 1)))

``lr = base_lr × factor``. Worked example (lr 3e-4, warmup 1, max 4, cosine, ρ 0.1): factors
1, 1, 0.775, 0.325, 0.1 for s = 0..4. The horizon is ``scheduler.max_steps``; the config layer
makes it follow the run target unless set explicitly (SPEC §3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from speedtronic.config import RunConfig, SchedulerConfig, SpeedtronicConfig


@dataclass
class LRSchedule:
    """Picklable LR factor ``f(s)`` (its attributes land in ``LambdaLR.state_dict()``).

    The defaults are the config's (``scheduler.*``; the horizon the default run target).
    """

    name: str = SchedulerConfig.name
    warmup_steps: int = SchedulerConfig.warmup_steps
    max_steps: int = RunConfig.max_steps
    min_lr_ratio: float = SchedulerConfig.min_lr_ratio

    def __call__(self, step: int) -> float:
        """Multiplier of the base learning rate after ``step`` completed updates."""
        warmup, total = max(0, int(self.warmup_steps)), max(1, int(self.max_steps))
        if warmup > 0 and step < warmup:
            return max(1e-8, (step + 1) / warmup)
        if self.name == "constant":
            return 1.0
        progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
        ratio = float(self.min_lr_ratio)
        return ratio + (1.0 - ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule_from_config(config: SpeedtronicConfig | SchedulerConfig) -> LRSchedule:
    """The :class:`LRSchedule` of a full config or of its (validated) ``scheduler`` section.

    A bare section needs an explicit ``max_steps``; in a full config an unset horizon already
    follows the run target. ``ValueError`` when there is none.
    """
    section = config.scheduler if isinstance(config, SpeedtronicConfig) else config
    if section.max_steps is None:
        raise ValueError(
            "scheduler.max_steps is unset: set it, or pass the whole SpeedtronicConfig so the "
            "horizon follows the run target"
        )
    return LRSchedule(
        name=section.name,
        warmup_steps=section.warmup_steps,
        max_steps=section.max_steps,
        min_lr_ratio=section.min_lr_ratio,
    )


def build_scheduler(optimizer: Optimizer, config: SpeedtronicConfig | SchedulerConfig) -> LambdaLR:
    """``LambdaLR`` over ``optimizer`` following ``config.scheduler`` (see the module docstring).

    Step it once per *applied* optimizer update (not on GradScaler-skipped steps).
    """
    return LambdaLR(optimizer, schedule_from_config(config))
