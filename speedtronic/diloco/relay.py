"""A group leader's link to the top-level exchange: hierarchical rounds that cut commits.

With K nodes in G groups, each group's members meet their leader through a shared volume; the
leader runs a master whose outer step is replaced by this relay: it averages its members'
contributions (every member weighs the same), uploads that mean to the top-level exchange as
**one** contribution that weighs as many nodes as it includes, waits for the top-level
global of the next round and hands it back to publish to the members. The top-level master
sees G contributions per round instead of K, so a round costs G + 1 Hub commits (one account
or one repository), and every node still weighs the same in the outer step.

Configure the leader as ``role: master`` of its group's exchange with ``relay_to`` naming the
top-level exchange; members are ordinary workers of the group's exchange. The top-level master
lists the leaders' node ids in ``distributed.relay_leaders``: a contribution weighing more than
one node is refused from anyone else.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from speedtronic.diloco.exchange import GlobalMetadata, TransportError
from speedtronic.diloco.master import META, RoundState

__all__ = ["Upstream"]

_LOG = logging.getLogger("speedtronic.diloco")


class Upstream:
    """The relay: ``current()`` is the top-level global, ``forward()`` sends a group's mean
    and returns the global that includes it.

    ``record(**status)`` builds the leader's status record for the top level (its claim);
    ``stop`` ends a wait (the master is stopping). Lines go to the ``speedtronic.diloco``
    logger.
    """

    def __init__(
        self,
        transport: Any,
        *,
        node_id: str,
        settings: Any,
        record: Callable[..., dict[str, Any]],
        stop: threading.Event,
    ):
        self.store = transport
        self.node_id = node_id
        self.settings = settings
        self._record = record
        self._stop = stop
        self.instance = str(record().get("instance", ""))
        self.max_bytes: int | None = None  # set by the master from its model
        self.last_round: int | None = None  # the last round this group contributed to

    def _fetch_newer(self, than: int, run_id: str) -> tuple[GlobalMetadata, dict] | None:
        metadata = self.store.global_metadata()
        if metadata is None:
            return None
        newer = metadata.outer_step > than or (run_id and metadata.run_id != run_id)
        if not newer:
            return None
        return self.store.fetch_global(metadata, max_bytes=self.max_bytes)

    def _wait(
        self, than: int, run_id: str, what: str, timeout: float | None = None
    ) -> tuple[GlobalMetadata, dict]:
        """Poll the top level until a global newer than ``than`` (or of another run) is out;
        past ``timeout`` seconds (None: until stopped) a ``TransportError`` says what was
        awaited and for how long (the master retries at its next poll)."""
        started = time.monotonic()
        while not self._stop.is_set():
            waited = time.monotonic() - started
            if timeout is not None and waited >= timeout:
                raise TransportError(
                    f"relay: no {what} within {waited:.1f} s (distributed.round_timeout "
                    f"{timeout:g} s); waiting again at the master's next poll"
                )
            try:
                found = self._fetch_newer(than, run_id)
            except TransportError as exc:
                _LOG.warning(f"relay: reading the top-level global failed: {exc}")
                found = None
            if found is not None:
                return found
            self._stop.wait(self.settings.poll_interval)
        raise TransportError(f"relay stopped while waiting for {what}")

    def current(self) -> tuple[GlobalMetadata, dict[str, torch.Tensor]]:
        """The top-level global (waits for the top-level master's first publish)."""
        self.store.claim_owner(self.node_id, self._record(state="training", relay=True))
        # bounded: at startup this runs on the training thread (the master retries it)
        return self._wait(-1, "", "first top-level global", self.settings.round_timeout)

    def agree(self, store: Any, held: RoundState, max_bytes: int) -> RoundState:
        """The leader's reconcile: the group starts from the top-level global (its outer step
        and run id are the group's), published to the group's exchange ``store`` unless the
        members have it already. Returns the state the group's master holds from now on.
        After a group publish that failed once the mean went up, ``held`` is that round's
        state (its ledger marks the members' files), so they are never sent up twice."""
        self.max_bytes = max_bytes
        meta, weights = self.current()
        state = held.copy()
        state.adopt(weights, meta.outer_step)
        state.run_id = meta.run_id
        remote = store.global_metadata()
        if remote is None or (remote.outer_step, remote.run_id) != (meta.outer_step, meta.run_id):
            store.publish_global(
                state.global_state,
                outer_step=state.outer_step,
                ledger=state.ledger,
                metadata_extra={**META, "relay": "true"},
                run_id=state.run_id,
                node_records=state.node_records(),
            )
        return state

    def forward(
        self,
        mean: Mapping[str, torch.Tensor],
        *,
        round: int,
        weight: int,
        run_id: str,
        final: bool,
    ) -> tuple[GlobalMetadata, dict[str, torch.Tensor]]:
        """Upload the group's ``mean`` as its contribution to ``round`` (weighing ``weight``
        nodes: the top master honours it from the ids in its ``distributed.relay_leaders``),
        then return the first top-level global after it."""
        status = {"state": "done", "final_round": round} if final else {"state": "training"}
        started = time.perf_counter()
        self.store.upload_delta(
            mean,
            node_id=self.node_id,
            round_index=round,
            local_step=round,
            base_outer_step=round,
            dtype=self.settings.delta_dtype,
            block_size=self.settings.delta_block_size,
            metadata={
                "weight": str(int(weight)),
                "run_id": run_id,
                "final": str(final).lower(),
                "instance": self.instance,
            },
            owner=self._record(relay=True, **status),
        )
        self.last_round = round
        _LOG.info(
            f"relay: round {round} of {weight} nodes sent up in "
            f"{time.perf_counter() - started:.2f} s",
        )
        return self._wait(round, run_id, f"top-level global {round + 1}")

    def finish(self) -> None:
        """The group's run is over: say so at the top level, so its master stops waiting for
        this group (the group may have ended after a round that was not marked final)."""
        final = -1 if self.last_round is None else self.last_round
        self.store.claim_owner(
            self.node_id, self._record(relay=True, state="done", final_round=final)
        )
        _LOG.info(f"relay: group done after round {final}; told the top level")
