"""Compatibility module: the 2.0.0 ``speedtronic.scheduling`` names (stream scheduling for
out-of-order backprop, now ``speedtronic.train.ooo``; LR schedules live in
``speedtronic.optim.schedules``)."""

from __future__ import annotations

from speedtronic.train.ooo import StageInfo, StageStreamScheduler

__all__ = ["StageInfo", "StageStreamScheduler"]
