"""The master's state across restarts: its local outer state and its agreement with the
published state (bootstrap, adopt a newer global, re-publish, a new run over a finished one).

:class:`MasterState` is a part of :class:`~speedtronic.diloco.master.RoundMaster`; it reads and
writes the master's fields under its lock. The files are those of
:mod:`speedtronic.diloco.outer_state`.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from speedtronic.diloco import tensors as T
from speedtronic.diloco.outer import NesterovOuterOptimizer
from speedtronic.diloco.outer_state import OuterStateStore
from speedtronic.diloco.transport import GLOBAL_PROCESSED, TransportError

__all__ = ["META", "MasterState"]

META = {"algorithm": "dumb_diloco", "optimizer": "nesterov_sgd"}


class MasterState:
    """Local persistence and reconcile of the round master (see the module docstring)."""

    hub: Any
    settings: Any
    upstream: Any
    store: OuterStateStore
    state_dir: Path
    global_state: dict[str, torch.Tensor]
    _initial: dict[str, torch.Tensor]
    optimizer: NesterovOuterOptimizer
    outer_step: int
    ledger: dict[str, int]
    run_id: str
    digests: dict[str, str]
    fresh: bool
    reconciled: bool
    has_local_state: bool
    local_state_corrupt: bool
    on_global: Callable[[int, dict[str, torch.Tensor]], None] | None
    _lock: threading.RLock
    _log: Any
    _emit: Callable[[str, dict[str, Any]], None]
    _clock: Callable[[], float]
    _opened: float
    _handed: int | None
    _reset_tally: Callable[[], None]

    def _new_optimizer(self) -> NesterovOuterOptimizer:
        return NesterovOuterOptimizer(
            self.global_state, self.settings.outer_lr, self.settings.outer_momentum
        )

    # -- local persistence ------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        """The local outer state file (see :mod:`speedtronic.diloco.outer_state`)."""
        return self.store.path

    def _load_local_state(self) -> None:
        try:
            saved = self.store.load(self.global_state)
        except ValueError as exc:
            self.local_state_corrupt = True
            self._log.error(
                f"corrupt local outer state in {self.state_dir} ({exc}); "
                "moved aside, rebuilding from the published global state"
            )
            return
        if saved is None:
            return
        self.global_state = saved.global_state
        self.optimizer = self._new_optimizer()
        self.optimizer.load_state_dict(saved.momentum)
        self.outer_step, self.ledger, self.run_id = saved.outer_step, saved.ledger, saved.run_id
        self.digests = saved.digests
        self.has_local_state = True

    def _save_local_state(self) -> None:
        self.store.save(
            self.global_state,
            self.optimizer.state_dict(),
            outer_step=self.outer_step,
            run_id=self.run_id,
            ledger=self.ledger,
            digests=self.digests,
        )
        self.has_local_state = True

    def _persist(self) -> None:
        try:
            self._save_local_state()
        except OSError as exc:
            self._log.warning(f"could not persist local outer state: {exc}")

    # -- reconcile with the published state ---------------------------------------------
    def reconcile(self) -> None:
        """Agree with the repository once: bootstrap, adopt a newer global, or re-publish.

        A failed read raises (the caller retries); it never leads to a bootstrap that could
        overwrite a live global. A ``fresh`` master (not resuming) that finds the final global
        of a finished run starts a new run over it, from outer step 0 with an empty ledger.
        """
        if self.upstream is not None:
            self._reconcile_with_upstream()
            return
        remote = self.hub.global_metadata()
        stale: list[str] = []
        if remote is not None and remote.final and self.fresh:
            self._log.warning(
                f"the exchange holds the final global of a finished run (outer step "
                f"{remote.outer_step}); starting a new run over it"
            )
            with self._lock:
                self.global_state = T.cpu_state_dict(self._initial)
                self.outer_step, self.ledger, self.run_id, self.digests = 0, {}, "", {}
                self.optimizer = self._new_optimizer()
            stale = self._leftovers()
            remote = None
        if remote is None:
            if not self.run_id:
                self.run_id = secrets.token_hex(6)
            self.hub.publish_global(
                self.global_state,
                outer_step=self.outer_step,
                ledger=self.ledger,
                prune=stale,
                metadata_extra={**META, "bootstrap": str(self.outer_step == 0).lower()},
                run_id=self.run_id,
            )
            self._log.info(f"published global state at outer step {self.outer_step} (bootstrap)")
        else:
            book = self.hub.read_json(GLOBAL_PROCESSED, default={})
            booked = book.get("outer_step") if isinstance(book, dict) else None
            local_ok = self.has_local_state and not self.local_state_corrupt
            record = remote
            # the ledger ahead of the record: a publish torn between its files; the weights'
            # own header says which outer step they hold
            torn = isinstance(booked, int) and booked > remote.outer_step
            if remote.outer_step > self.outer_step or not local_ok or torn:
                try:
                    remote, state = self.hub.fetch_global(remote, max_bytes=self._max_global_bytes)
                except TransportError as exc:
                    if exc.kind != "permanent" or not local_ok:
                        raise  # retried at the next poll; never a bootstrap over it
                    self._log.error(f"{exc}; publishing this master's own global over it")
                    remote = dataclasses.replace(remote, outer_step=-1)
                else:
                    if remote.outer_step > self.outer_step or not local_ok:
                        self._adopt(state, remote.outer_step)
                        self.run_id = remote.run_id
                        self._log.info(
                            f"adopted published global at outer step {remote.outer_step}"
                        )
            if not isinstance(booked, int) or booked <= self.outer_step:
                with self._lock:  # a ledger for a global we hold (never one ahead of it)
                    for node, done in self.hub.read_ledger().items():
                        self.ledger[node] = max(done, self.ledger.get(node, -1))
            repaired = remote.sha256 != record.sha256
            if remote.outer_step < self.outer_step or repaired:
                self.hub.publish_global(
                    self.global_state,
                    outer_step=self.outer_step,
                    ledger=self.ledger,
                    metadata_extra=META,
                    run_id=self.run_id,
                )
        self._finish_reconcile()

    def _finish_reconcile(self) -> None:
        self.reconciled = True
        self.local_state_corrupt = False
        self.fresh = False  # a later reconcile (after a failed publish) is never a new run
        self._persist()
        report = self.store.take_pending(self.outer_step, self.run_id)
        if report is not None:  # published by this master, never reported (killed, or lost reply)
            self._reset_tally()
            self._emit("outer_step", {**report, "recovered": True})
        if self._handed != self.outer_step:  # a re-reconcile after a failed publish may not move
            self._opened = self._clock()
            self._hand_over(T.cpu_state_dict(self.global_state))

    def _hand_over(self, state: dict[str, torch.Tensor]) -> None:
        self._handed = self.outer_step
        if self.on_global is not None:
            self.on_global(self.outer_step, state)

    def _reconcile_with_upstream(self) -> None:
        """A group leader starts from the top-level global (its outer step and run id are the
        group's), publishing it to the members unless they have it already."""
        self.upstream.max_bytes = self._max_global_bytes
        meta, state = self.upstream.current()
        with self._lock:
            self._adopt(state, meta.outer_step)
            self.run_id = meta.run_id
        remote = self.hub.global_metadata()
        if remote is None or (remote.outer_step, remote.run_id) != (meta.outer_step, meta.run_id):
            self.hub.publish_global(
                self.global_state,
                outer_step=self.outer_step,
                ledger=self.ledger,
                metadata_extra={**META, "relay": "true"},
                run_id=self.run_id,
            )
        self._finish_reconcile()

    def _leftovers(self) -> list[str]:
        """Files of a finished run: its contributions and the records of nodes that were done."""
        scan = self.hub.scan()
        paths = [path for files in scan.deltas.values() for path in files.values()]
        for node_id in scan.owners:
            if (self.hub.read_owner(node_id) or {}).get("state") == "done":
                paths.append(f"nodes/{node_id}/owner.json")
        return sorted(paths)

    def _adopt(self, state: Mapping[str, torch.Tensor], outer_step: int) -> None:
        with self._lock:
            for key, value in state.items():
                mine = self.global_state.get(key)
                if mine is not None and tuple(value.shape) == tuple(mine.shape):
                    self.global_state[key] = T.cpu_tensor(value).to(mine.dtype)
            self.outer_step = int(outer_step)
            self.optimizer = self._new_optimizer()

    @property
    def _max_global_bytes(self) -> int:
        values = sum(v.numel() * v.element_size() for v in self.global_state.values())
        return values + (1 << 20)
