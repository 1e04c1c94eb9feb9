"""The master's agreement with the published state, once at start and after a failed publish.

:func:`reconcile` reads the exchange and returns the round state the master should hold from
now on (the exchange holds it when it returns); it never changes the state it is given. The
cases, in order:

- a ``fresh`` master (training from step 0) over the final global of a finished run: a new run
  from the initial weights, with the old run's contributions and done records pruned;
- nothing published: bootstrap (publish the held global, with a new run id when none);
- a newer published global, or no trusted local state: adopt the published one (checked
  finite as the model's dtypes); when it is unusable (corrupt, non-finite, too large) the
  master republishes its own local state, or fails with :class:`ExchangeError` (exit 2) when
  it has none: it never loops on a global it cannot read;
- a ledger ahead of the weights' record (a publish torn between its files): the weights' own
  header says which step they hold, and the held global is published again over it;
- the published ledger is merged into the held one (a master with a lost disk never
  aggregates a contribution twice), and with an adopted global the records beside it (which
  nodes finished, as which instance: a lost reply to the last round's publish, a restart or
  a lost disk never leaves the run waiting for nodes that are done).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from speedtronic.diloco import tensors as T
from speedtronic.diloco.outer_state import RoundState
from speedtronic.diloco.retry import ExchangeError, HubUnavailable
from speedtronic.diloco.transport import GLOBAL_PROCESSED, GlobalMetadata, TransportError

__all__ = ["META", "max_global_bytes", "reconcile"]

_LOG = logging.getLogger("speedtronic.diloco")

META = {"algorithm": "dumb_diloco", "optimizer": "nesterov_sgd"}
CORRUPT_READS = 3  # reads of an unchanged record before its weights count as unusable
CORRUPT_WAIT = 0.2  # seconds before the second read (then twice that)


def max_global_bytes(like: Mapping[str, torch.Tensor]) -> int:
    """The largest global file a model shaped and typed as ``like`` can have (+ 1 MiB)."""
    return sum(v.numel() * v.element_size() for v in like.values()) + (1 << 20)


def reconcile(
    store: Any,
    held: RoundState,
    *,
    trusted: bool,
    fresh: bool,
    new_run: Callable[[], RoundState],
) -> RoundState:
    """Agree with the exchange ``store`` (see the module docstring); returns the state to hold.

    ``trusted``: ``held`` was read from (or saved to) the master's own valid local state and
    may be republished; ``fresh``: the master starts training from step 0; ``new_run()``: the
    state of a new run. A failed read raises ``TransportError`` (the caller retries); it never
    leads to a bootstrap that could overwrite a live global.
    """
    remote = store.global_metadata()
    state = held.copy()
    stale: list[str] = []
    if remote is not None and remote.final and fresh:
        _LOG.warning(
            f"the exchange holds the final global of a finished run (outer step "
            f"{remote.outer_step}); starting a new run over it"
        )
        state = new_run()
        stale = _leftovers(store)
        remote = None
    if remote is None:
        state.run_id = state.run_id or secrets.token_hex(6)
        store.publish_global(
            state.global_state,
            outer_step=state.outer_step,
            ledger=state.ledger,
            prune=stale,
            metadata_extra={**META, "bootstrap": str(state.outer_step == 0).lower()},
            run_id=state.run_id,
            node_records=state.node_records(),
        )
        _LOG.info(f"published global state at outer step {state.outer_step} (bootstrap)")
        return state
    book = store.read_json(GLOBAL_PROCESSED, default={})
    booked = book.get("outer_step") if isinstance(book, dict) else None
    record = remote
    adopted = False
    # the ledger ahead of the record: a publish torn between its files; the weights' own
    # header says which outer step they hold
    torn = isinstance(booked, int) and booked > remote.outer_step
    if remote.outer_step > state.outer_step or not trusted or torn:
        fetched = _fetch(store, remote, state.global_state, trusted)
        if fetched is None:  # unusable: this master's own global goes over it
            remote = dataclasses.replace(remote, outer_step=-1)
        else:
            remote, weights = fetched
            if remote.outer_step > state.outer_step or not trusted:
                state.adopt(weights, remote.outer_step)
                state.run_id = remote.run_id
                adopted = True
                _LOG.info(f"adopted published global at outer step {remote.outer_step}")
    if not isinstance(booked, int) or booked <= state.outer_step:
        for node, done in store.read_ledger().items():  # never a ledger ahead of the global
            state.ledger[node] = max(done, state.ledger.get(node, -1))
    if booked == state.outer_step:  # who finished, as whom: never lost with a reply
        state.take_node_records(store.read_node_records(), newer=adopted)
    repaired = remote.sha256 != record.sha256
    if remote.outer_step < state.outer_step or repaired:
        store.publish_global(
            state.global_state,
            outer_step=state.outer_step,
            ledger=state.ledger,
            metadata_extra=META,
            run_id=state.run_id,
            node_records=state.node_records(),
        )
    return state


def _fetch(
    store: Any,
    remote: GlobalMetadata,
    like: Mapping[str, torch.Tensor],
    trusted: bool,
) -> tuple[GlobalMetadata, dict[str, torch.Tensor]] | None:
    """The published global, finite as the model's dtypes ``like``; None when it is unusable
    and the master may republish its own (``trusted``), else ``ExchangeError``."""
    problem = _unusable(store, remote, like)
    if not isinstance(problem, str):
        return problem
    where = f"{remote.model_file} (outer step {remote.outer_step}) of {store.repo_id!r}"
    if not trusted:
        raise ExchangeError(
            f"distributed.repo_id: the published global {where} is unusable ({problem}) and "
            "this master has no local outer state to publish over it; restore its "
            "distributed.state_dir, or delete global/ from the exchange to start a new run"
        )
    _LOG.error(
        f"the published global {where} is unusable ({problem}); publishing this master's "
        "own global over it"
    )
    return None


def _unusable(
    store: Any, remote: GlobalMetadata, like: Mapping[str, torch.Tensor]
) -> tuple[GlobalMetadata, dict[str, torch.Tensor]] | str:
    """The global and its record, or why it cannot be used. A read that fails while the
    record stays the same is tried ``CORRUPT_READS`` times: a file read mid-write (or a
    truncated reply) reads whole the next time, garbage never does. An outage (the record
    cannot be read) raises ``TransportError``: retried at the next poll."""
    for attempt in range(1, CORRUPT_READS + 1):
        try:
            fetched, weights = store.fetch_global(
                remote, max_bytes=max_global_bytes(like), like=like
            )
        except TransportError as exc:
            if exc.kind == "permanent":
                return str(exc)
            if isinstance(exc, HubUnavailable):
                raise  # an outage, not the file: retried at the next poll
            if attempt == CORRUPT_READS:
                return f"{exc}, {CORRUPT_READS} reads of the same record"
            time.sleep(CORRUPT_WAIT * attempt)
            again = store.global_metadata()
            if again is None or again.sha256 != remote.sha256:
                raise  # the exchange changed meanwhile: agree again at the next poll
            continue
        bad = T.first_non_finite(weights, like=like)
        if bad is None:
            return fetched, weights
        return f"{bad} is not finite as the model's {like[bad].dtype}"
    raise AssertionError("unreachable")


def _leftovers(store: Any) -> list[str]:
    """Files of a finished run: its contributions and the records of nodes that were done."""
    scan = store.scan()
    paths = [path for files in scan.deltas.values() for path in files.values()]
    for node_id in scan.owners:
        if (store.read_owner(node_id) or {}).get("state") == "done":
            paths.append(f"nodes/{node_id}/owner.json")
    return sorted(paths)
