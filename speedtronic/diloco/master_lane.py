"""The master's lane of a DumbDiLoCo node: repository set-up, the outer loop, its newest global.

:class:`MasterLane` creates the repository and grants the collaborators write access at
startup (a failure is logged; training continues locally), hosts
:class:`~speedtronic.diloco.outer.MasterOuterLoop` (aggregation on its own daemon thread), and
keeps the newest global that loop published as one ``(outer_step, state)`` snapshot for the
training thread, which installs it at a round boundary. On a worker the lane is never opened:
``loop`` stays None and its state methods do nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from speedtronic.diloco.outer import MasterOuterLoop

__all__ = ["MasterLane"]


class MasterLane:
    """The master's outer loop and the hand-off of each global it publishes."""

    def __init__(
        self,
        hub: Any,
        config: Any,
        *,
        state_dir: str | os.PathLike,
        poll_interval: float,
        emit: Callable[[str, dict[str, Any]], None],
        say: Callable[[str, str], None],
        log: Any,
    ):
        self.hub = hub
        self.config = config
        self.state_dir = state_dir
        self.poll_interval = poll_interval  # seconds between the outer loop's delta scans
        self._emit = emit
        self._say = say
        self._log = log
        self.loop: MasterOuterLoop | None = None
        self.snapshot: tuple[int, dict[str, torch.Tensor]] | None = None

    def open(self, state: dict[str, torch.Tensor]) -> None:
        """Create the repository, grant write access, build the outer loop from ``state``."""
        try:
            self.hub.create_repo(private=True)
        except Exception as exc:
            self._say(
                "warning", f"master repository initialization failed; continuing locally: {exc}"
            )
        for name in getattr(self.config, "collaborators", None) or []:
            try:
                self.hub.add_collaborator(name, permission="write")
            except Exception as exc:
                self._say("warning", f"could not grant write access to {name}: {exc}")
        self.loop = MasterOuterLoop(
            self.hub,
            state,
            node_state_dir=self.state_dir,
            outer_lr=float(getattr(self.config, "outer_lr", 0.7)),
            outer_momentum=float(getattr(self.config, "outer_momentum", 0.9)),
            poll_interval=self.poll_interval,
            on_global_update=self._on_global_update,
            emit=self._emit,
            log=self._log,
        )

    def reconcile(self) -> None:
        """Catch up with the repository (a failure is logged; the loop retries later)."""
        try:
            self.loop.reconcile()
        except Exception as exc:
            self._say("warning", f"master could not reconcile with the repository yet: {exc}")

    def newer_snapshot(self, than: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The published ``(outer_step, state)`` if its step is above ``than``, else None."""
        snapshot = self.snapshot
        if snapshot is None or snapshot[0] <= than:
            return None
        return snapshot

    def _on_global_update(self, state: dict[str, torch.Tensor], outer_step: int) -> None:
        self.snapshot = (int(outer_step), state)  # one assignment: step and tensors agree

    # -- state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any] | None:
        """The outer loop's state, or None on a worker."""
        return self.loop.state_dict() if self.loop is not None else None

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore the outer loop's state (nothing on a worker or without one)."""
        if self.loop is not None and state:
            self.loop.load_state_dict(state)
