"""A node's link to the exchange, and its identity there.

:class:`NodeLink` is everything one node reads from and writes to the exchange: its claim on
its id, its uploads (:meth:`NodeLink.send`, the round's ``send``), the globals it fetches
(:meth:`NodeLink.fetch`, the round's inbox source: the full global, or the held one plus the
quantized outer update, and the mean first moments published with it, each checked before
it is handed over) and the wait for a run's first global. :class:`NodeClaim` is this
process's claim on its node id (``nodes/<id>/owner.json``) and the takeover of a dead
holder's; :func:`resolve_node_id` finds the id. The round itself (:mod:`.node`) knows none
of this: the coordinator hands it ``send`` and an inbox fed by ``fetch``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from speedtronic.background import wait_for
from speedtronic.config import ConfigError
from speedtronic.config.limits import check_node_id
from speedtronic.diloco import codec
from speedtronic.diloco import exchange as T
from speedtronic.diloco.codec import HeldGlobal
from speedtronic.diloco.exchange import (
    Emit,
    ExchangeError,
    FileInfo,
    RoundSettings,
    Store,
    ignore,
    scrub,
)
from speedtronic.diloco.node import Contribution, GlobalCandidate
from speedtronic.retry import AccessRefused, RemoteNotFound, TransportError

__all__ = [
    "ExchangeAccessError",
    "NodeClaim",
    "NodeIdCollisionError",
    "NodeLink",
    "resolve_node_id",
]

_LOG = logging.getLogger("speedtronic.diloco")

#: A node's status record on the exchange (``nodes/<id>/owner.json``), as JSON.
Record = Mapping[str, object]

#: Reads of a global that met a publish between its files before the error goes up, and
#: the seconds between them (a publish writes its few files within milliseconds).
TORN_READS = 10
TORN_WAIT = 0.1


def _unusable(exc: TransportError | ValueError) -> str:
    """Why a published file cannot be used, in one line (the full global is read instead); an
    outage, which a later poll may get past, is raised again."""
    outage = isinstance(exc, TransportError) and exc.kind != "permanent"
    if outage and not isinstance(exc, RemoteNotFound):
        raise exc
    return str(exc)


def _published_as(state: Mapping[str, torch.Tensor], metadata: T.GlobalMetadata) -> bool:
    """Whether ``state`` is the global ``metadata`` names: its weights file's sha256,
    computed here over the file the master would have written, is the record's (or, for a
    final mean with no weights file, its digest is the record's ``mean_digest``)."""
    if metadata.mean_digest:
        return codec.state_digest(state) == metadata.mean_digest
    header = T.weights_header(metadata)
    return codec.safetensors_sha256(state, metadata=header) == metadata.sha256


class NodeLink:
    """What one node reads from and writes to the exchange: its claim on its id (see
    :class:`NodeClaim`), its uploads (:meth:`send`), the globals (:meth:`fetch`) and the
    wait for a run's first global. Errors no retry fixes are an :class:`ExchangeAccessError`
    or ``ExchangeError`` (exit 2) naming the repository, never the token. ``max_bytes``
    bounds a global file; ``like`` is the model's state (a global must be finite in its
    dtypes); ``interrupted`` ends every wait; ``secrets`` (the token) never appear in a
    message."""

    def __init__(
        self,
        store: Store,
        settings: RoundSettings,
        *,
        claim: NodeClaim,
        max_bytes: int,
        like: Mapping[str, torch.Tensor],
        interrupted: threading.Event,
        emit: Emit = ignore,
        secrets: tuple[str, ...] = (),
        own: Store | None = None,
    ):
        self.store = store
        self.own = own  # the master's own node: its contributions go to the master's disk
        self.settings = settings
        self.secrets = secrets  # scrubbed from every message (the token)
        self.claim = claim
        self.node_id = claim.node_id
        self.max_bytes = max_bytes
        self.like = like
        self.interrupted = interrupted
        self._emit = emit
        self.beat = time.monotonic()  # the last sign of life while waiting here
        self._displaced = ""  # the instance whose record this node took over at its claim
        # the displaced holder's round files when the watch ended, until our first upload
        self._watched: dict[str, FileInfo] | None = None
        self._holder = ""  # the displaced holder, as the log lines name it
        self._refused = ""  # checksum of a published global this node refused
        self._refused_moments: tuple[int, str] | None = None  # (outer step, run) refused
        self._told: set[str] = set()  # "node/round" refusals of our files already reported
        self.held: HeldGlobal | None = None  # the last global fetched (updates follow)
        # with final_average 2: the global held before it (the final is the mean of the two)
        self.before: HeldGlobal | None = None
        self._update_bytes = 0  # size of the last update file read
        # a fresh worker's own starting weights while it looks for its first global: the
        # master's first global is them byte for byte when built alike (same seed and model)
        self._start: Mapping[str, torch.Tensor] | None = None
        self._not_own = ""  # sha256 of an announced global 0 that is not this node's weights
        self._beats, self._beat_failing = 0, False  # liveness beats sent; the last one failed
        # the Hub's beat: the round seen waited for at the last look, the round beaten
        self._waited: int | None = None
        self._beaten: int | None = None

    # -- errors no retry fixes ---------------------------------------------------------------
    def raise_if_permanent(self, exc: BaseException, what: str) -> None:
        """A permanent exchange error (auth refused, unusable path, invalid repo id) ends the
        node with exit code 2; an outage does not."""
        if isinstance(exc, AccessRefused):
            raise self.access_error(exc) from None
        if isinstance(exc, TransportError) and exc.kind == "permanent":
            message = f"distributed.repo_id: {what} {self.store.repo_id!r}: {exc}"
            raise ExchangeError(scrub(message, self.secrets)) from None

    def access_error(self, exc: AccessRefused) -> ExchangeAccessError:
        """Exit 2: the exchange refused this node's token; names the repository (the
        entrypoint adds where the token came from), never the token."""
        message = (
            f"distributed.repo_id: {self.store.repo_id!r} refused this node (HTTP "
            f"{exc.status or '?'}): {exc}; check that distributed.token exists and may write "
            "this repository"
        )
        return ExchangeAccessError(
            scrub(message, self.secrets),
            repo_id=str(self.store.repo_id),
            status=exc.status,
        )

    # -- the claim on the node id ------------------------------------------------------------
    def check_id(self) -> None:
        """Before a worker waits for a run: a live process on this host holding the id is a
        `NodeIdCollisionError` at once (nothing is written)."""
        try:
            owner = self.store.read_owner(self.node_id)
        except Exception as exc:
            self.raise_if_permanent(exc, "cannot read from the exchange")
            return  # an outage: claim_id checks again
        if self._collides(owner):
            raise NodeIdCollisionError(self.node_id)

    def claim_id(self, **status: object) -> None:
        """Write our claim/status record (``state`` and, when done, ``final_round``); another
        live node holding the id is a `NodeIdCollisionError`, raised before any write."""
        try:
            owner = self.store.read_owner(self.node_id)
            if self._collides(owner):
                raise NodeIdCollisionError(self.node_id)
            if owner is not None and self.claim.held_elsewhere(owner):
                self._watched = self._watch_holder(owner)
            other = (owner or {}).get("instance")
            if other and other != self.claim.instance:
                self._displaced = str(other)
            if other != self.claim.instance or (owner or {}).get("state") != status["state"]:
                self.store.claim_owner(self.node_id, self.claim.record(**status))
            self.claim.claimed = True
        except NodeIdCollisionError:
            raise
        except Exception as exc:
            self.raise_if_permanent(exc, "cannot write to the exchange")
            _LOG.warning(f"could not claim node_id {self.node_id}: {exc}")

    def _round_files(self, *, beat: bool = False) -> dict[str, FileInfo]:
        """This id's files on the exchange but its status record and, unless ``beat``, its
        liveness beat (this node writes both too)."""
        prefix, skip = f"nodes/{self.node_id}/", {f"nodes/{self.node_id}/owner.json"}
        if not beat:
            skip.add(T.beat_path(self.node_id))
        files = self.store.scan().files.items()
        return {p: i for p, i in files if p.startswith(prefix) and p not in skip}

    def _watch_holder(self, owner: Record) -> dict[str, FileInfo]:
        """Another host's unfinished node holds our id: watch its files for up to
        ``liveness_timeout`` when it beats (a live node beats every ``heartbeat_interval``),
        else ``drop_after`` x ``round_timeout`` (it writes once a round). A change is a
        `NodeIdCollisionError`; none means its instance is gone and the id is taken over.
        Returns the holder's round files (checked again before our first upload)."""
        self._holder = holder = f"instance {owner.get('instance')} on host {owner.get('host', '?')}"
        rules = self.settings.rules
        before, started = self._round_files(beat=True), time.monotonic()
        if T.beat_path(self.node_id) in before and rules.liveness_timeout > 0:
            window, bound = rules.liveness_timeout, "distributed.liveness_timeout: it beats"
        else:
            window = max(rules.drop_after, 1) * rules.round_timeout
            bound = "distributed.drop_after x round_timeout, as long as the master waits for it"
        _LOG.info(
            f"node id {self.node_id!r} is held by {holder} (state {owner.get('state')}); "
            f"watching its files for up to {window:.0f} s ({bound}) before taking the id over"
        )

        def changed() -> bool:
            self.beat = time.monotonic()
            return self._round_files(beat=True) != before

        pause = min(self.settings.rules.poll_interval, 1.0)
        if wait_for(changed, timeout=window, interval=pause, stop=self.interrupted):
            self._emit("node_id_collision", node_id=self.node_id)
            waited = time.monotonic() - started
            raise NodeIdCollisionError(
                self.node_id, f"{holder} wrote to the exchange {waited:.1f} s into the watch"
            )
        _LOG.info(
            f"{holder} wrote nothing in {time.monotonic() - started:.1f} s; taking node id "
            f"{self.node_id!r} over (that instance is gone)"
        )
        return {p: i for p, i in before.items() if p != T.beat_path(self.node_id)}

    def _collides(self, owner: Record | None) -> bool:
        other = self.claim.check(owner)
        if other is None:
            return False
        _LOG.error(
            f"node_id collision: another live node uses node_id {self.node_id!r} (instance "
            f"{other}); give each node a unique distributed.node_id"
        )
        self._emit("node_id_collision", node_id=self.node_id)
        return True

    def _check_still_ours(self, job: Contribution) -> None:
        """Before an upload: the record and the watched holder's files say whether another
        live node uses our id (this node stops; nothing of the other is lost)."""
        owner = self.store.read_owner(self.node_id) or {}
        later = ""
        if self._displaced and owner.get("instance") == self._displaced:
            later = f"instance {self._displaced} wrote again after this node took the id over"
        elif self._watched is not None and self._round_files() != self._watched:
            # the holder uploaded after our watch: an upload of ours could take its place
            later = (
                f"{self._holder} wrote round files after this node's watch ended; this node "
                "stops before its first upload"
            )
        if later:
            self._emit("node_id_collision", node_id=self.node_id)
            raise NodeIdCollisionError(self.node_id, later)
        if self._collides(owner):  # a later instance took our id over after our claim
            _LOG.error(
                f"node id {self.node_id!r} was taken over by instance {owner.get('instance')} "
                f"on host {owner.get('host', '?')} after this node claimed it; this node's "
                f"round {job.round} upload reclaims it and the later instance stops at its "
                "next upload (a round it uploaded first stands for this node's)"
            )

    # -- liveness and leaving -------------------------------------------------------------
    def send_beat(self) -> None:
        """One liveness beat (``nodes/<id>/beat.json``, a counter): the master takes a node
        whose beat stopped for ``liveness_timeout`` for gone. A beat that fails is a beat
        missed: said once per run of failures, never raised."""
        self._beats += 1
        try:
            self.store.write_beat(
                self.node_id, {"instance": self.claim.instance, "beat": self._beats}
            )
        except Exception as exc:
            if not self._beat_failing:
                _LOG.warning(f"liveness beat failed (retried every beat): {exc}")
            self._beat_failing = True
        else:
            self._beat_failing = False

    def beat_if_waited(self, round: int) -> None:
        """The Hub's beat (a commit): once per round, when another node's contribution to
        ``round`` (the one this node owes) was listed at two looks in a row, a
        ``heartbeat_interval`` apart, while this node's was not: the others wait for it.
        Nodes that finish a round together send none."""
        try:
            deltas = self.store.scan().deltas
        except Exception:  # an outage: the master credits everyone the time it cannot read
            return
        others = any(round in files for node, files in deltas.items() if node != self.node_id)
        waited = others and round not in deltas.get(self.node_id, {})
        seen, self._waited = self._waited, round if waited else None
        if waited and seen == round and self._beaten != round:
            self._beaten = round
            self.send_beat()

    def leave(self, *, resume: bool) -> None:
        """Record that this node left the run (``state: left`` in its status record): the
        master stops waiting for it at once; ``resume``: it may come back with --resume."""
        try:
            self.store.claim_owner(self.node_id, self.claim.record(state="left", resume=resume))
        except Exception as exc:
            _LOG.warning(
                f"could not record that this node left ({exc}); the master stops waiting for "
                "it once its liveness beat is missed (distributed.liveness_timeout)"
            )
            return
        again = "it may come back with --resume" if resume else "no checkpoint to resume from"
        _LOG.info(f"node {self.node_id} left the run; the exchange says so ({again})")

    # -- uploads -----------------------------------------------------------------------------
    def send(self, job: Contribution) -> int:
        """Upload one contribution with our status record (one commit); returns bytes. The
        master's own node (``own``: a store on the master's disk) hands its file over there,
        never through the exchange, which then gets only a change of the status record
        (written first: a failure leaves nothing behind, and the contribution is carried)."""
        with contextlib.suppress(TransportError):  # the upload below reports an outage
            self._check_still_ours(job)
        status: dict[str, object] = {"state": "training"}
        if job.final:
            status = {"state": "done", "final_round": job.round}
        sink = self.own or self.store
        local = sink is not self.store
        try:
            if job.delta is None or (local and (job.final or not self.claim.claimed)):
                self.store.claim_owner(self.node_id, self.claim.record(**status))
            nbytes = 0
            if job.delta is not None:
                sink.upload_delta(
                    job.wire if job.wire is not None else job.delta,
                    node_id=self.node_id,
                    round_index=job.round,
                    local_step=job.step,
                    base_outer_step=job.base,
                    dtype=self.settings.wire.delta_dtype,
                    block_size=self.settings.wire.block_size,
                    metadata={
                        "final": str(job.final).lower(),
                        "run_id": job.run_id,
                        "instance": self.claim.instance,
                    },
                    owner=None if local else self.claim.record(**status),
                )
                nbytes = int(sink.last_upload_bytes)
        except AccessRefused as exc:  # the node stops at its next step (exit 2)
            raise self.access_error(exc) from None
        self.claim.claimed = True
        self._watched = None  # our files are on the exchange now: the record tells from here
        return nbytes

    # -- globals -----------------------------------------------------------------------------
    def fetch(self, seen: tuple[int, str], final: bool = False) -> GlobalCandidate | None:
        """The published global when its ``(outer_step, run_id)`` is not ``seen``, or with
        ``final`` when it is the final one (a node that waits for the end of the run); a refused
        one (too large, non-finite) is reported once and not downloaded again. A read that met
        a publish between its files (`TornRead`) reads again once the record changes (for at
        most ``TORN_READS`` polls); a record that does not change raises (the caller retries)."""
        started = time.perf_counter()
        metadata = self.store.global_metadata()
        deadline = time.monotonic() + TORN_READS * TORN_WAIT
        while True:
            try:
                return self._fetch(metadata, seen, started, final)
            except T.TornRead:
                newer = self._newer_record(metadata, deadline)
                if newer is None:
                    raise
                metadata = newer[0]

    def _newer_record(
        self, old: T.GlobalMetadata | None, deadline: float
    ) -> tuple[T.GlobalMetadata | None] | None:
        """The version record once it differs from ``old``, polled until ``deadline``."""

        def changed() -> tuple[T.GlobalMetadata | None] | None:
            record = self.store.global_metadata()
            return (record,) if record != old else None

        remaining = max(deadline - time.monotonic(), 0.0)
        return wait_for(changed, timeout=remaining, interval=TORN_WAIT, stop=self.interrupted)

    def _fetch(
        self, metadata: T.GlobalMetadata | None, seen: tuple[int, str], started: float, final: bool
    ) -> GlobalCandidate | None:
        """`fetch` of the global ``metadata`` names."""
        if metadata is None or (metadata.names(*seen) and not (final and metadata.final)):
            return None
        self._hear_refusals(metadata)
        if metadata.sha256 and metadata.sha256 == self._refused:
            return None
        held = self._from_update(metadata)
        if held is not None:
            return self._fetched(metadata, held.state, started, "update", held)
        own = self._own_start(metadata)
        if own is not None:
            return self._fetched(metadata, own, started, "own")
        mean = self._final_mean(metadata)
        if mean is not None:
            return self._fetched(metadata, mean, started, "mean")
        try:
            metadata, state = self.store.fetch_global(metadata, max_bytes=self.max_bytes)
            # as it will be installed: a float64 1e300 is finite in the file, inf in float32
            # (keys and shapes are the node's to judge: another model ends the node, exit 2)
            bad = codec.first_non_finite(state, like=self.like)
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
        return self._fetched(metadata, state, started, "full")

    def _own_start(self, metadata: T.GlobalMetadata) -> dict[str, torch.Tensor] | None:
        """This fresh node's starting weights when ``metadata``'s weights file holds exactly
        them (its sha256, computed here, is the record's): a copy, and nothing downloaded.
        None otherwise (another seed, model or dtype, or a later global)."""
        start = self._start
        if start is None or metadata.chain or not metadata.sha256:
            return None
        if not _published_as(start, metadata):
            return None
        _LOG.info(
            f"global {metadata.outer_step} holds this node's own starting weights byte for "
            "byte (same seed and model as the master): nothing to download"
        )
        return {key: value.detach().to("cpu").clone() for key, value in start.items()}

    def _final_mean(self, metadata: T.GlobalMetadata) -> dict[str, torch.Tensor] | None:
        """A final global that is the mean of the last two globals, made here as the master
        made it, from the two this node holds (the last round ended on a boundary: the final
        record came after the last global) or from the one before the last and the published
        update that made the last (``mean_update``); taken when it hashes to the weights
        file's sha256, with nothing else downloaded. None when this node cannot (it holds
        other globals) or the result differs (said: the weights file is downloaded instead).
        An outage raises."""
        held, before, step = self.held, self.before, metadata.outer_step
        if not metadata.final or held is None or held.run_id != metadata.run_id:
            return None
        if held.outer_step == step and before is not None and before.outer_step == step - 1:
            pair, size = [before, held], 0
        elif held.outer_step != step - 1 or not metadata.mean_update:
            return None
        error = "it does not hash to the published weights file"
        try:
            if held.outer_step == step - 1:
                pair, size = self._with_mean_update(metadata, held)
            mean = dict(pair[1].state)
            mean.update(codec.average_states([pair[0].state, pair[1].state]))
            if _published_as(mean, metadata):
                self._update_bytes = size
                return mean
        except (TransportError, ValueError) as exc:
            error = _unusable(exc)
        _LOG.warning(
            f"not computing the final global {step} from the held global: {error}; "
            "downloading it instead"
        )
        return None

    def _hold(self, new: HeldGlobal) -> None:
        """Hold ``new``; with ``final_average`` 2 the one it follows stays as :attr:`before`
        (kept, not copied: a new global never writes into the old one's tensors)."""
        last, self.before = self.held, None
        follows = last is not None and (last.outer_step + 1, last.run_id) == (
            new.outer_step,
            new.run_id,
        )
        if self.settings.outer.final_average == 2 and follows:
            self.before = last
        self.held = new

    def _with_mean_update(
        self, metadata: T.GlobalMetadata, held: HeldGlobal
    ) -> tuple[list[HeldGlobal], int]:
        """``held`` and the last global made from it by the update a final record names
        (``mean_update``), and that file's size."""
        step = metadata.outer_step
        with self.store.local_copy(T.update_path(step), max_bytes=self.max_bytes) as local:
            size = local.stat().st_size
            last = codec.read_update(
                local,
                held,
                sha256=metadata.mean_update,
                outer_step=step,
                run_id=held.run_id,
                like=self.like,
            )
        return [held, last], size

    def _hear_refusals(self, metadata: T.GlobalMetadata) -> None:
        """The record names the contributions the master refused (damaged, counted corrupt
        and pruned): this node's are said once, as an error and a ``delta_refused`` event."""
        for name in metadata.refused:
            node, _, round = name.partition("/")
            if node != self.node_id or name in self._told:
                continue
            self._told.add(name)
            _LOG.error(
                f"the master refused this node's contribution to round {round} (unreadable, "
                "damaged or unusable; counted corrupt and pruned): that round's progress is "
                "not in the global; see the master's log for why"
            )
            self._emit("delta_refused", round=int(round), outer_step=metadata.outer_step)

    def _fetched(
        self,
        metadata: T.GlobalMetadata,
        state: dict[str, torch.Tensor],
        started: float,
        how: str,
        held: HeldGlobal | None = None,
    ) -> GlobalCandidate:
        weights = sum(v.numel() * v.element_size() for v in state.values())
        nbytes = {"update": self._update_bytes, "mean": self._update_bytes, "own": 0}.get(
            how, weights
        )
        if self.settings.updates_follow:  # the next update applies to this global
            self._hold(held or HeldGlobal.of(metadata.outer_step, metadata.run_id, state))
        seconds = time.perf_counter() - started
        candidate = GlobalCandidate(
            metadata.outer_step, state, seconds, metadata.final, metadata.run_id, how, nbytes
        )
        found = self._moments(metadata) if self.settings.outer.moments != "off" else None
        if found is not None:
            round, moments, size = found
            candidate.moments = (round, moments)
            candidate.nbytes += size  # what this global cost to download, the moments with it
        return candidate

    def _moments(
        self, metadata: T.GlobalMetadata
    ) -> tuple[int, dict[str, torch.Tensor], int] | None:
        """The mean first moments published with global ``metadata`` names (its record's
        ``moments_round``: the round they were sent with) and their file's size, or None when
        it has none."""
        record = self.store.read_json(T.GLOBAL_STEP, default={})
        if not isinstance(record, dict) or record.get("outer_step") != metadata.outer_step:
            return None
        round = record.get("moments_round")
        which = (metadata.outer_step, metadata.run_id)
        if not isinstance(round, str) or which == self._refused_moments:
            return None
        bound = T.max_moments_bytes(self.like)
        try:
            with (
                self.store.local_copy(T.GLOBAL_MOMENTS, max_bytes=bound) as local,
                codec.open_delta(local) as reader,
            ):
                if reader.metadata.get("outer_step") != str(metadata.outer_step):
                    return None  # a later publish's: this global's were replaced
                return int(round), reader.values(), local.stat().st_size
        except TransportError as exc:
            if exc.kind != "permanent" and not isinstance(exc, RemoteNotFound):
                raise  # an outage: the next poll reads the global and its moments again
            error = str(exc)
        except ValueError as exc:
            error = f"{T.GLOBAL_MOMENTS} is unreadable: {exc}"
        self._refused_moments = which  # said once; the global itself is installed
        _LOG.error(
            f"refusing the mean first moments published with global {metadata.outer_step}: "
            f"{error}; this node keeps its own"
        )
        self._emit("moments_rejected", outer_step=metadata.outer_step, error=error)
        return None

    def _from_update(self, metadata: T.GlobalMetadata) -> HeldGlobal | None:
        """The global ``metadata`` names, as the held global + the published outer updates
        after it; None when none applies, or one is unusable (said once; the full global is
        downloaded instead). An outage raises (the next poll tries again)."""
        held = self.held  # none, of another run or no update leads from it: the full global
        if held is None or held.run_id != metadata.run_id:
            return None
        if metadata.updates_after(held.outer_step) is None:
            return None
        try:
            held, self._update_bytes = self.store.apply_updates(
                metadata, held, like=self.like, max_bytes=self.max_bytes
            )
            return held
        except (TransportError, ValueError) as exc:
            error = _unusable(exc)
        _LOG.warning(
            f"not applying the outer updates to global {metadata.outer_step}: {error}; "
            "downloading the full global instead"
        )
        self._emit("global_update_refused", outer_step=metadata.outer_step, error=error)
        return None

    def first_global(self, run_id: str, resumed: bool) -> tuple[GlobalCandidate | None, str]:
        """A worker's global to start from: ``(candidate, "")``, or ``(None, why)`` when it
        has no run to take part in. A final global ends a run: a node of that run is done;
        another waits (<= ``round_timeout``) for a new run's first global. With no global, a
        fresh node waits as long for the first (None: its own weights); a resumed one not.
        A fresh node whose weights are the first global already (`_own_start`) downloads
        nothing, and takes it as soon as the master announced the run (:meth:`_announced`),
        before the weights file is uploaded."""
        self._start = None if resumed else self.like
        try:
            return self._first_global(run_id, resumed)
        finally:
            self._start = None

    def _first_global(self, run_id: str, resumed: bool) -> tuple[GlobalCandidate | None, str]:
        try:
            candidate = self.fetch((-1, ""))
        except Exception as exc:
            self.raise_if_permanent(exc, "cannot read from the exchange")
            _LOG.warning(f"initial global read failed; will retry: {exc}")
            candidate = None
        timeout = self.settings.rules.round_timeout
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
            candidate = self._announced("")
            if candidate is not None:
                return candidate, ""
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

    def _announced(self, old_run: str) -> GlobalCandidate | None:
        """Global 0 of a new run (not ``old_run``) the master announced before uploading it,
        when this fresh node's own weights are that global (:meth:`_own_start`): taken at
        once, nothing downloaded. None otherwise (then the node waits for the weights file)."""
        if self._start is None:
            return None
        try:
            record = self.store.announced()
        except TransportError as exc:
            self.raise_if_permanent(exc, "cannot read from the exchange")
            return None
        if record is None or record.run_id == old_run or record.sha256 == self._not_own:
            return None
        own = self._own_start(record)
        if own is None:  # another seed or model: this announcement is not hashed again
            self._not_own = record.sha256
            return None
        return self._fetched(record, own, time.perf_counter(), "own")

    def _wait_for_global(self, seen: tuple[int, str]) -> tuple[GlobalCandidate | None, float]:
        """Poll (at most ``round_timeout``, interruptible) for a published global other than
        ``seen`` that is not final; returns it (None: none came) and the seconds waited."""
        started = time.monotonic()

        def published() -> GlobalCandidate | None:
            nonlocal seen
            self.beat = time.monotonic()
            try:
                candidate = self.fetch(seen)
            except Exception as exc:
                self.raise_if_permanent(exc, "cannot read from the exchange")
                return None
            if candidate is not None and candidate.final:
                seen, candidate = (candidate.outer_step, candidate.run_id), None
            return candidate or self._announced(seen[1])

        rules = self.settings.rules
        pause, timeout = min(rules.poll_interval, 1.0), rules.round_timeout
        candidate = wait_for(published, timeout=timeout, interval=pause, stop=self.interrupted)
        return candidate, time.monotonic() - started


# -- identity --------------------------------------------------------------------------
_NODE_ENV = ("SPEEDTRONIC_NODE_ID", "HOSTNAME", "HF_USERNAME", "USER")


def resolve_node_id(configured: str | None, environ: Mapping[str, str]) -> str:
    """``node_id`` -> SPEEDTRONIC_NODE_ID -> HOSTNAME -> HF_USERNAME -> USER -> ``local``,
    checked by the config layer's one node-id rule (else ``ConfigError``)."""
    candidates = [configured, *(environ.get(name) for name in _NODE_ENV), "local"]
    value = next(str(c).strip() for c in candidates if c is not None and str(c).strip())
    return check_node_id(value)


class NodeIdCollisionError(ConfigError):
    """Another live node already uses this node's id, found at the claim (before the node
    trains or writes anything) or, for the later of two nodes, when the earlier one writes
    again: exit code 2. ``detail`` says how it was found."""

    def __init__(self, node_id: str, detail: str = "") -> None:
        found = f" ({detail})" if detail else ""
        super().__init__(
            f"distributed.node_id: another live node already uses node id {node_id!r}{found}; "
            "give each worker a unique id (SPEEDTRONIC_NODE_ID, distributed.node_id, or a "
            "unique hostname)"
        )
        self.node_id = node_id


class ExchangeAccessError(ConfigError):
    """The exchange refused this node's credentials (HTTP 401/403, or 404 for its own
    repository): exit code 2. The message names the repository, never the token."""

    def __init__(self, message: str, *, repo_id: str, status: int | None = None) -> None:
        super().__init__(message)
        self.repo_id, self.status = repo_id, status

    def with_token_source(self, source: str | None) -> ExchangeAccessError:
        """The same error, naming where ``distributed.token`` came from (``env:HF_TOKEN``,
        ``secret:hf_token``, ``file``, ``cli``; None: no token was configured)."""
        where = source or "nowhere: no token is set (distributed.token, HF_TOKEN, hf_token secret)"
        return ExchangeAccessError(
            f"{self}; the token came from {where}", repo_id=self.repo_id, status=self.status
        )


class NodeClaim:
    """This process's claim on ``node_id``: the ``nodes/<id>/owner.json`` record, written at
    startup and with every upload, with the round status the master reads. Another live
    instance's token there is a collision (:class:`NodeIdCollisionError`, exit 2). A dead
    holder's claim is taken over: on this host when its pid is gone; from another host when
    its files did not change for ``liveness_timeout`` (it beats) or ``drop_after`` x
    ``round_timeout`` (as long as the master waits for a silent node;
    :meth:`NodeLink.claim_id`), and a holder that writes after
    that stops this node before its first upload. The instance token survives restarts in
    ``<state_dir>/identity.json``."""

    def __init__(self, node_id: str, role: str, state_dir: Path, host: str | None = None):
        self.node_id, self.role = node_id, role
        self.instance = self._instance_token(state_dir / "identity.json")
        self.host = host or socket.gethostname()
        self.claimed = False
        self.reported: set[str] = set()
        self.started = round(_process_started(), 3)
        self.beats = False  # it sends liveness beats (the master then expects them)

    @staticmethod
    def _instance_token(path: Path) -> str:
        try:
            return str(json.loads(path.read_text(encoding="utf-8"))["instance"])
        except (OSError, ValueError, KeyError, TypeError):
            token = secrets.token_hex(8)
            with contextlib.suppress(OSError):
                path.write_text(json.dumps({"instance": token}) + "\n", encoding="utf-8")
            return token

    def record(self, **status: object) -> dict[str, object]:
        """The claim record with the node's round status (``state``: ``training``, ``done``
        or ``aggregator``; ``final_round`` when done)."""
        return {
            "node_id": self.node_id,
            "instance": self.instance,
            "role": self.role,
            "host": self.host,
            "pid": os.getpid(),
            "started": self.started,  # the process's start (wall clock): the master reports
            "beats": self.beats,  # the time to its first aggregated contribution; no other
            **status,  # timestamp: an unchanged record keeps its blob id (the master skips it)
        }

    def check(self, owner: Record | None) -> str | None:
        """The instance token of a live colliding node (reported once), else None."""
        other = owner.get("instance") if owner else None
        if owner is None or not other or other == self.instance or other in self.reported:
            return None
        pid = owner.get("pid")
        # after our claim, somebody overwrote it; before it, only a running process on this
        # host is provably live
        live = self.claimed or (
            owner.get("host") == self.host
            and isinstance(pid, int)
            and pid != os.getpid()
            and _pid_alive(pid)
        )
        if not live:
            return None
        self.reported.add(str(other))
        return str(other)

    def held_elsewhere(self, owner: Record) -> bool:
        """Whether ``owner`` is another instance's record, written on another host by a node
        that has not finished: it may be live, and only its files can tell."""
        other = owner.get("instance")
        if not other or other == self.instance or owner.get("host") == self.host:
            return False
        return owner.get("state") in ("training", "aggregator")


def _process_started() -> float:
    """When this process started (Unix time; from Linux's /proc, else now)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = float(Path("/proc/stat").read_text().split("\nbtime ", 1)[1].split()[0])
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        return True
    return True
