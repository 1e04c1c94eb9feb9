"""One node's link to the exchange: its claim on its node id, its uploads, its reads of the
published global, and the wait for the first global of a run.

The coordinator (:mod:`speedtronic.diloco.coordinator`) builds one :class:`NodeLink` and
hands :meth:`NodeLink.send` to the node's uploader and :meth:`NodeLink.fetch` to its inbox.
Identity (see :mod:`speedtronic.diloco.identity`): the claim is written before the node
writes anything else; another live node holding the id is a `NodeIdCollisionError` (exit 2);
a record of another host's unfinished node is watched for ``drop_after`` x ``round_timeout``
(as long as the master waits for a silent node before it drops it) before the id is taken over;
every upload reads the record back first, and a node that took an id over stops before its first
upload when the holder's round files changed since its watch. Errors no retry fixes (auth
refused, an unusable path) become an `ExchangeAccessError` or `ExchangeError` (exit 2) naming the
repository, never the token.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from speedtronic.diloco import tensors as T
from speedtronic.diloco.identity import ExchangeAccessError, NodeClaim, NodeIdCollisionError
from speedtronic.diloco.mailbox import Contribution, Emit, GlobalCandidate, ignore
from speedtronic.diloco.retry import AccessRefused, ExchangeError, TransportError, scrub

__all__ = ["NodeLink"]

_LOG = logging.getLogger("speedtronic.diloco")


class NodeLink:
    """What one node reads from and writes to the exchange ``store``.

    ``settings`` is the ``distributed`` config section (``repo_id``, ``token``,
    ``round_timeout``, ``poll_interval``, ``delta_dtype``); ``claim`` this process's claim on
    its node id; ``max_bytes`` the largest global file this node's model can have; ``like``
    the model's state (a global must be finite in its dtypes);
    ``interrupted`` ends every wait early (a stop was requested).
    """

    def __init__(
        self,
        store: Any,
        settings: Any,
        *,
        claim: NodeClaim,
        max_bytes: int,
        like: Mapping[str, torch.Tensor],
        interrupted: threading.Event,
        emit: Emit = ignore,
    ):
        self.store = store
        self.settings = settings
        self.claim = claim
        self.node_id = claim.node_id
        self.max_bytes = max_bytes
        self.like = like
        self.interrupted = interrupted
        self._emit = emit
        self.beat = time.monotonic()  # the last sign of life while waiting here
        self._displaced = ""  # the instance whose record this node took over at its claim
        # the displaced holder's round files when the watch ended, until our first upload
        self._watched: dict[str, Any] | None = None
        self._holder = ""  # the displaced holder, as the log lines name it
        self._refused = ""  # checksum of a published global this node refused

    # -- errors no retry fixes ---------------------------------------------------------------
    def raise_if_permanent(self, exc: BaseException, what: str) -> None:
        """A permanent exchange error (auth refused, unusable path, invalid repo id) ends the
        node with exit code 2; an outage does not."""
        if isinstance(exc, AccessRefused):
            raise self.access_error(exc) from None
        if isinstance(exc, TransportError) and exc.kind == "permanent":
            repo = self.settings.repo_id
            raise ExchangeError(
                scrub(f"distributed.repo_id: {what} {repo!r}: {exc}", (self.settings.token,))
            ) from None

    def access_error(self, exc: AccessRefused) -> ExchangeAccessError:
        """Exit 2: the exchange refused this node's token; names the repository (the
        entrypoint adds where the token came from), never the token."""
        message = (
            f"distributed.repo_id: {self.settings.repo_id!r} refused this node (HTTP "
            f"{exc.status or '?'}): {exc}; check that distributed.token exists and may write "
            "this repository"
        )
        return ExchangeAccessError(
            scrub(message, (self.settings.token,)),
            repo_id=str(self.settings.repo_id),
            status=exc.status,
        )

    # -- the claim on the node id ------------------------------------------------------------
    def check_id(self) -> None:
        """Before a worker waits for a run to join: a live process on this host already
        holding the id is a `NodeIdCollisionError` at once (nothing is written; the claim
        itself, with the watch of another host's holder, comes once a run is found)."""
        try:
            owner = self.store.read_owner(self.node_id)
        except Exception as exc:
            self.raise_if_permanent(exc, "cannot read from the exchange")
            return  # an outage: claim_id checks again
        if self._collides(owner):
            raise NodeIdCollisionError(self.node_id)

    def claim_id(self, **status: Any) -> None:
        """Write our claim/status record (``status``: ``state`` and, when done,
        ``final_round``); another live node holding the id is a `NodeIdCollisionError`,
        raised before this node writes anything."""
        try:
            owner = self.store.read_owner(self.node_id)
            if self._collides(owner):
                raise NodeIdCollisionError(self.node_id)
            if self.claim.held_elsewhere(owner):
                self._watched = self._watch_holder(owner)
            other = (owner or {}).get("instance")
            if other and other != self.claim.instance:
                self._displaced = str(other)
            if other != self.claim.instance or owner.get("state") != status["state"]:
                self.store.claim_owner(self.node_id, self.claim.record(**status))
            self.claim.claimed = True
        except NodeIdCollisionError:
            raise
        except Exception as exc:
            self.raise_if_permanent(exc, "cannot write to the exchange")
            _LOG.warning(f"could not claim node_id {self.node_id}: {exc}")

    def _round_files(self) -> dict[str, Any]:
        """This id's files on the exchange but its status record (which we write too)."""
        prefix, record = f"nodes/{self.node_id}/", f"nodes/{self.node_id}/owner.json"
        files = self.store.scan().files.items()
        return {p: i for p, i in files if p.startswith(prefix) and p != record}

    def _watch_holder(self, owner: Mapping[str, Any]) -> dict[str, Any]:
        """Another host's node holds our id and had not finished: watch its files for up to
        ``drop_after`` x ``round_timeout`` (a live node writes once a round, and a round may
        last minutes; the master drops a node only after as long a silence). A change is a
        `NodeIdCollisionError`; none means its instance is gone, and the id is taken over.
        Returns the holder's round files at the end (checked again before our first upload)."""
        holder = f"instance {owner.get('instance')} on host {owner.get('host', '?')}"
        self._holder = holder
        cfg = self.settings
        window = max(int(cfg.drop_after), 1) * cfg.round_timeout
        _LOG.info(
            f"node id {self.node_id!r} is held by {holder} (state {owner.get('state')}); "
            f"watching its files for up to {window:.0f} s (distributed.drop_after x "
            "distributed.round_timeout, as long as the master waits for a silent node) before "
            "taking the id over"
        )
        before, started = self._round_files(), time.monotonic()
        while time.monotonic() - started < window and not self.interrupted.is_set():
            self.beat = time.monotonic()
            time.sleep(min(cfg.poll_interval, 1.0))
            if self._round_files() != before:
                waited = time.monotonic() - started
                self._emit("node_id_collision", node_id=self.node_id)
                raise NodeIdCollisionError(
                    self.node_id, f"{holder} wrote to the exchange {waited:.1f} s into the watch"
                )
        _LOG.info(
            f"{holder} wrote nothing in {time.monotonic() - started:.1f} s; taking node id "
            f"{self.node_id!r} over (that instance is gone)"
        )
        return before

    def _collides(self, owner: Mapping[str, Any] | None) -> bool:
        other = self.claim.check(owner)
        if other is None:
            return False
        _LOG.error(
            f"node_id collision: another live node uses node_id {self.node_id!r} (instance "
            f"{other}); give each node a unique distributed.node_id"
        )
        self._emit("node_id_collision", node_id=self.node_id)
        return True

    # -- uploads -----------------------------------------------------------------------------
    def send(self, job: Contribution) -> int:
        """Upload one contribution with our status record (one commit); returns bytes."""
        with contextlib.suppress(TransportError):  # the upload below reports an outage
            owner = self.store.read_owner(self.node_id)
            if self._displaced and (owner or {}).get("instance") == self._displaced:
                # the instance this node took the id over from writes again: it is live, and
                # this node is the later of the two (it stops; nothing of the other is lost)
                self._emit("node_id_collision", node_id=self.node_id)
                raise NodeIdCollisionError(
                    self.node_id,
                    f"instance {self._displaced} wrote again after this node took the id over",
                )
            if self._watched is not None and self._round_files() != self._watched:
                # the holder uploaded after our watch ended (its record may since be ours
                # again): it is live; an upload of ours could take its round's place
                self._emit("node_id_collision", node_id=self.node_id)
                raise NodeIdCollisionError(
                    self.node_id,
                    f"{self._holder} wrote round files after this node's watch ended; this "
                    "node stops before its first upload",
                )
            if self._collides(owner):  # a later instance took our id over after our claim
                _LOG.error(
                    f"node id {self.node_id!r} was taken over by instance "
                    f"{(owner or {}).get('instance')} on host {(owner or {}).get('host', '?')} "
                    f"after this node claimed it; this node's round {job.round} upload "
                    "reclaims it and the later instance stops at its next upload (a round it "
                    "uploaded first stands for this node's)"
                )
        status = {"state": "done", "final_round": job.round} if job.final else {"state": "training"}
        try:
            if job.delta is None:  # nothing left to contribute: only the done status
                record = self.claim.record(state="done", final_round=job.round)
                self.store.claim_owner(self.node_id, record)
                nbytes = 0
            else:
                self.store.upload_delta(
                    job.delta,
                    node_id=self.node_id,
                    round_index=job.round,
                    local_step=job.step,
                    base_outer_step=job.base,
                    dtype=self.settings.delta_dtype,
                    metadata={
                        "final": str(job.final).lower(),
                        "run_id": job.run_id,
                        "instance": self.claim.instance,
                    },
                    owner=self.claim.record(**status),
                )
                nbytes = int(self.store.last_upload_bytes)
        except AccessRefused as exc:  # the node stops at its next step (exit 2)
            raise self.access_error(exc) from None
        self.claim.claimed = True
        self._watched = None  # our files are on the exchange now: the record tells from here
        return nbytes

    # -- globals -----------------------------------------------------------------------------
    def fetch(self, seen: tuple[int, str]) -> GlobalCandidate | None:
        """The published global when its ``(outer_step, run_id)`` is not ``seen``; a refused
        one (too large, non-finite) is reported once and not downloaded again."""
        started = time.perf_counter()
        metadata = self.store.global_metadata()
        if metadata is None or (metadata.outer_step, metadata.run_id) == seen:
            return None
        if metadata.sha256 and metadata.sha256 == self._refused:
            return None
        try:
            metadata, state = self.store.fetch_global(metadata, max_bytes=self.max_bytes)
            # as it will be installed: a float64 1e300 is finite in the file, inf in float32
            # (keys and shapes are the node's to judge: another model ends the node, exit 2)
            bad = T.first_non_finite(state, like=self.like)
            if bad is not None:
                raise TransportError(
                    f"{metadata.model_file} (outer step {metadata.outer_step}) holds values "
                    f"that are not finite in this model's dtype in {bad}",
                    kind="permanent",
                )
        except TransportError as exc:
            if exc.kind != "permanent":
                raise
            self._refused = metadata.sha256
            _LOG.error(f"refusing the published global: {exc}")
            self._emit("global_rejected", outer_step=metadata.outer_step, error=str(exc))
            return None
        return GlobalCandidate(
            metadata.outer_step,
            state,
            time.perf_counter() - started,
            metadata.final,
            metadata.run_id,
        )

    def first_global(self, run_id: str, resumed: bool) -> tuple[GlobalCandidate | None, str]:
        """A worker's global to start from, before its first step: ``(candidate, "")``, or
        ``(None, why)`` when this node has no run to take part in.

        A global marked final ends a run. A node resumed into that run (its ``run_id``) has
        nothing left to do. Any other node never trains from it: it waits (at most
        ``round_timeout``) for the first global of a new run, and when none comes, its run
        has ended too. With no global at all, a fresh node waits as long for the master's
        first one (None: it trains from its own weights); a ``resumed`` node goes on from its
        checkpointed round at once.
        """
        try:
            candidate = self.fetch((-1, ""))
        except Exception as exc:
            self.raise_if_permanent(exc, "cannot read from the exchange")
            _LOG.warning(f"initial global read failed; will retry: {exc}")
            candidate = None
        timeout = self.settings.round_timeout
        if candidate is not None and candidate.final:
            old = f"outer step {candidate.outer_step}, run {candidate.run_id or '?'}"
            if run_id and candidate.run_id == run_id:
                return None, (
                    f"this node's run already ended: the exchange holds its final global "
                    f"({old}); nothing left to contribute"
                )
            _LOG.info(
                f"the exchange holds the final global of a finished run ({old}); not training "
                f"from it: waiting up to {timeout:.0f} s (distributed.round_timeout) for the "
                "first global of a new run"
            )
            candidate, waited = self._wait_for_global((candidate.outer_step, candidate.run_id))
            if candidate is None and not self.interrupted.is_set():
                return None, (
                    f"the run on the exchange already ended (final global: {old}) and no "
                    f"new run started within {waited:.1f} s of waiting; nothing to join"
                )
        elif candidate is None and not resumed:
            _LOG.info(
                f"waiting up to {timeout:.0f} s (distributed.round_timeout) for the master's "
                "first global state"
            )
            candidate, waited = self._wait_for_global((-1, ""))
            if candidate is None and not self.interrupted.is_set():
                _LOG.warning(
                    f"no global state was published within {waited:.1f} s of waiting; "
                    "training from local weights (the first global is merged when it arrives)"
                )
        return candidate, ""

    def _wait_for_global(self, seen: tuple[int, str]) -> tuple[GlobalCandidate | None, float]:
        """Poll (at most ``round_timeout``, interruptible) for a published global other than
        ``seen`` that is not final; returns it (None: none came) and the seconds waited."""
        started = time.monotonic()
        deadline = started + self.settings.round_timeout
        while not self.interrupted.is_set() and time.monotonic() < deadline:
            self.beat = time.monotonic()
            pause = min(self.settings.poll_interval, 1.0, max(deadline - time.monotonic(), 0))
            time.sleep(pause)
            try:
                candidate = self.fetch(seen)
            except Exception as exc:
                self.raise_if_permanent(exc, "cannot read from the exchange")
                candidate = None
            if candidate is not None and candidate.final:
                seen, candidate = (candidate.outer_step, candidate.run_id), None
            if candidate is not None:
                return candidate, time.monotonic() - started
        return None, time.monotonic() - started
