"""Warnings a valid config earns: settings that load but are probably not what was meant.

One function, `config_warnings`, read by the trainer (it logs each line when training starts)
and by ``speedtronic validate`` (it prints them before its verdict), so the dry run shows what
the run will say. Pure: no torch, no files, no environment.
"""

from __future__ import annotations

from speedtronic.config.schema import SpeedtronicConfig

__all__ = ["config_warnings"]


def config_warnings(config: SpeedtronicConfig) -> list[str]:
    """One line per config-derived warning of a run of ``config`` (empty when none).

    Today: a warmup that does not end before the scheduler horizon (allowed, SPEC §3
    "Scheduler horizon", so that ``load_config({"max_steps": 10})`` keeps working with the
    default warmup of 100).
    """
    messages = []
    warmup, horizon = config.scheduler.warmup_steps, config.scheduler.max_steps
    if warmup and horizon and warmup >= horizon:
        messages.append(
            f"scheduler.warmup_steps ({warmup}) >= scheduler.max_steps ({horizon}): the "
            "learning rate never leaves warmup in this run"
        )
    return messages
