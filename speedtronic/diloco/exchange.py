"""The exchange every DiLoCo role meets through: its layout, the :class:`Store` protocol and
its errors::

    global/latest.safetensors              global weights of outer step F <= R (native dtypes)
    global/update_<k>.safetensors          the outer update to k (global_dtype int8/int4, or
                                           fp32 with fragments: the fragment's new values): the
                                           ones after F make global R from the weights file
    global/start.json                      a new run's global 0 announced (run_id, sha256)
    global/step_count.json                 version record (outer_step R, sha256, run_id, final;
                                           a final mean's digest when no file holds it)
    global/processed.json                  ledger: per node, the highest round aggregated
                                           (and its final round, instance and digest)
    nodes/<node_id>/delta_<r>.safetensors  the node's contribution to round r
    nodes/<node_id>/owner.json             the node's claim and status (training/done/left)
    nodes/<node_id>/beat.json              the node's liveness beat (a counter; shared volume)

What a contribution is, how its values are encoded and what a file holds, with the checks
every read passes, are :mod:`.codec`'s. :class:`Store` writes the layout once, over six primitives;
:class:`RepoTransport` gives those primitives their retries over the five raw operations a
backend implements (create, grant, list, read, commit: one Hub commit (:mod:`.hub`), or temp
file + rename per file on a shared volume (:mod:`.directory`)).

Every failure of a primitive becomes a :class:`~speedtronic.retry.TransportError` of the
one retry policy (:class:`~speedtronic.retry.RetryPolicy`, in the neutral
:mod:`speedtronic.retry`: the model import and ``push`` use it too). The one reporting channel
of every role is here too: the ``speedtronic.diloco`` logger for lines, one :class:`Emit` for
structured events.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar, runtime_checkable

import torch

from speedtronic.config import ConfigError
from speedtronic.config.limits import is_valid_node_id
from speedtronic.config.redaction import scrub as scrub  # every form of the token (re-exported)
from speedtronic.diloco.codec import (
    HeldGlobal,
    average_states,
    delta_from_bytes,
    file_sha256,
    first_non_finite,
    open_safetensors,
    read_update,
    safetensors_sha256,
    save_safetensors,
    state_digest,
    write_delta,
    write_safetensors,
)
from speedtronic.retry import RemoteNotFound, RetryPolicy, TransportError

if TYPE_CHECKING:
    from speedtronic.config.ops_sections import DistributedConfig
    from speedtronic.diloco.codec import OuterUpdate, QuantizedTensor

R = TypeVar("R")
#: A decoded JSON value (what a record file holds).
Json = Any
#: What one commit writes: path -> bytes, or a staged local file read as it is sent.
Additions = Mapping[str, bytes | Path]


# -- errors ---------------------------------------------------------------------------
#: 2.0.0 names: ``HubError`` (RuntimeError) and ``HubUnavailable`` (HubError).
HubError = TransportError


class ExchangeError(ConfigError):
    """A permanent misconfiguration of the exchange (auth refused, repository or path not
    usable, a model that does not match): the node stops with exit code 2 and one line."""


class TornRead(TransportError):
    """The global's weights do not match ``step_count.json`` and are not newer than it: read
    while a publish was between its files (weights first, record last). Transient: the
    record that names these weights is on its way."""


_LOG = logging.getLogger("speedtronic.diloco")


# -- reporting ---------------------------------------------------------------------------
class Emit(Protocol):
    """The one structured reporting channel: ``emit("event_name", field=value, ...)``.

    Event names and fields are a public contract (the Prometheus sink and docs/metrics.md
    read them); log lines go to the ``speedtronic.diloco`` logger instead."""

    def __call__(self, event: str, /, **fields: object) -> None: ...


def ignore(event: str, /, **fields: object) -> None:
    """An :class:`Emit` that reports nothing (the default where nobody listens)."""


# -- the layout ----------------------------------------------------------------------------
GLOBAL_MODEL = "global/latest.safetensors"
GLOBAL_STEP = "global/step_count.json"
GLOBAL_PROCESSED = "global/processed.json"
#: A new run's announcement, written before its global 0 is uploaded: the record global 0
#: will have (run id, the weights file's sha256), so a worker whose own starting weights hash
#: to it starts training at once instead of waiting for the file.
GLOBAL_START = "global/start.json"
#: With ``global_dtype`` int8/int4 the weights file is uploaded again once the updates after
#: it cover this many models (and whenever a global is not the last one plus an update):
#: every 8 globals of whole-model updates, about every 32 of a quarter each (4 fragments); in
#: between a publish adds only the round's update, and a reader of the full global applies
#: the updates after the file (so a joiner downloads at most the file and this many models'
#: int8 updates, whatever the fragments). The new values of an fp32 global's fragment count
#: by their bytes (4 a value against int8's 1): every 4 globals with 2 fragments, every 8
#: with 4.
FULL_GLOBAL_EVERY = 8
#: The mean inner first moments published with a global (``distributed.sync_inner_momentum``).
GLOBAL_MOMENTS = "global/moments.safetensors"
# the records of each node that global/processed.json carries beside the ledger, by type
NODE_RECORDS: dict[str, type] = {"finals": int, "instances": str, "digests": str, "dropped": str}

_DELTA_NAME = re.compile(r"^delta_(0|[1-9][0-9]*)\.safetensors$")


def delta_path(node_id: str, round_index: int) -> str:
    """Remote path ``nodes/<node_id>/delta_<round>.safetensors`` of a node's contribution to
    round ``round_index`` (the outer step it is meant to update; 2.0.0 used the local step)."""
    return f"nodes/{node_id}/delta_{int(round_index)}.safetensors"


def beat_path(node_id: str) -> str:
    """Remote path of a node's liveness beat (the master reads only its listed version)."""
    return f"nodes/{node_id}/beat.json"


@dataclasses.dataclass(frozen=True)
class Sends:
    """What a publish was given of the weights (see :meth:`Store.publish_global`): the outer
    ``update`` to the global, whether the ``weights`` are to be sent, the update that made
    the last global (``last_update``) and whether the state is the mean of the last two."""

    update: OuterUpdate | None
    weights: bool
    last_update: OuterUpdate | None
    mean_of_two: bool


class WeightsUpload:
    """A weights file committed after the record that names it, on a thread of its own
    (``speedtronic-diloco-weights``): a new run's global 0, whose nodes hold it already, so
    the rounds after it publish their updates meanwhile (12 MB of fp32 weights take 10 s at
    9.6 Mbit/s; an update a fraction of that). A reader that needs the file meets a missing one
    until it lands (``RemoteNotFound``, tried again); one that holds the global does not. The
    staged file is removed once sent or failed; :attr:`error` holds a failure (after the
    store's retries), after which the next publish sends a weights file of its own."""

    def __init__(self, store: Store, local: Path, record: GlobalMetadata) -> None:
        self.record = record
        self.error: Exception | None = None
        self._store, self._local = store, local
        self._thread = threading.Thread(
            target=self._send, name="speedtronic-diloco-weights", daemon=True
        )
        self._thread.start()

    def _send(self) -> None:
        try:
            self._store.commit(  # giving way to the rounds' uploads (hub.UPLINK)
                {GLOBAL_MODEL: self._local},
                message=f"weights of global {self.record.outer_step}",
                background=True,
            )
        except Exception as exc:  # said here; the next publish sends a weights file of its own
            self.error = exc
            _LOG.warning(
                f"could not upload the weights of global {self.record.outer_step} ({exc}); "
                "the next global is published with a weights file of its own"
            )
        finally:
            shutil.rmtree(self._local.parent, ignore_errors=True)

    @property
    def running(self) -> bool:
        """Whether the upload is still under way."""
        return self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` s) for the upload; True once it landed."""
        self._thread.join(timeout)
        return not self.running and self.error is None


def update_share(update: OuterUpdate, state: Mapping[str, torch.Tensor]) -> float:
    """The part of the model ``update`` changes, by values of its floating tensors (the ones
    an outer step moves): 1.0 for every one, about a quarter for one of 4 fragments; exact
    new values (an fp32 global's fragment) count as many times as their bytes a value (a
    byte for int8 codes)."""
    total = sum(value.numel() for value in state.values() if value.is_floating_point())
    changed = sum(math.prod(q.shape) for q in update.encoded.values())
    changed += sum(v.numel() * v.element_size() for v in update.exact.values())
    return changed / total if total else 1.0


def weights_header(record: GlobalMetadata) -> dict[str, object]:
    """The header of the weights file of the global ``record`` names: a node that makes that
    global itself hashes its tensors under it to compare with the record's sha256."""
    return {"outer_step": record.outer_step, "run_id": record.run_id, "final": record.final}


def update_path(outer_step: int) -> str:
    """Remote path of the quantized outer update that makes global ``outer_step``."""
    return f"global/update_{int(outer_step)}.safetensors"


def parse_delta_path(path: str) -> tuple[str, int] | None:
    """``nodes/<node>/delta_<n>.safetensors`` -> ``(node, n)``; anything else -> None.

    Strict: the node must be a valid node id (one path segment) and ``n`` a canonical
    non-negative integer.
    """
    parts = str(path).split("/")
    if len(parts) != 3 or parts[0] != "nodes" or not is_valid_node_id(parts[1]):
        return None
    match = _DELTA_NAME.match(parts[2])
    return None if match is None else (parts[1], int(match.group(1)))


# -- the settings the roles read, built once from the distributed section -------------------
def syncs_momentum(mode: str, every: int, outer_step: int) -> bool:
    """Whether the round that makes global ``outer_step`` (1, 2, ...) averages the inner first
    moment: never (``off``), every round, or every ``every``-th (``every_n``)."""
    if mode == "off":
        return False
    return mode == "every_round" or outer_step % every == 0


@dataclasses.dataclass(frozen=True)
class RoundRules:
    """When rounds happen and how long anyone waits for them (docs/diloco.md "Settings")."""

    inner_steps: int  # local steps between two syncs of one tensor
    sync: str  # blocking | overlapped
    round_timeout: float
    poll_interval: float
    min_nodes: int
    expected_nodes: int
    max_staleness: int
    drop_after: int
    relay_leaders: tuple[str, ...]
    threaded_uploads: bool  # overlapped with async_delta_upload
    upload_shutdown_timeout: float
    reset_inner_optimizer: bool
    heartbeat_interval: float  # a node's liveness beat (Hub: a look whether it is waited for)
    liveness_timeout: float  # no beat for this long: not waited for (0: off)
    fragments: int = 1  # the model's parts, one synced per round
    overlap_steps: int = 0  # steps from a contribution to its global's merge (0: blocking)

    @property
    def beside_training(self) -> bool:
        """Rounds run while the nodes train (``sync: overlapped``)."""
        return self.sync == "overlapped"

    @property
    def round_steps(self) -> int:
        """Local steps per round: ``inner_steps / fragments``."""
        return self.inner_steps // self.fragments

    def steps_behind(self, outer_step: int) -> int:
        """The inner steps a node trained to reach global ``outer_step``."""
        return outer_step * self.round_steps


@dataclasses.dataclass(frozen=True)
class WireFormat:
    """How contributions and globals travel: ``delta_dtype`` with blocks of ``block_size``
    values, the global's ``global_dtype``, and error feedback for the lossy ones."""

    delta_dtype: str
    block_size: int
    global_dtype: str
    error_feedback: bool


@dataclasses.dataclass(frozen=True)
class OuterRule:
    """How a round's mean becomes the next global: ``kind`` (average, nesterov, adaptive with
    ``adaptive_c``/``adaptive_max``), the outer ``lr`` and ``momentum``, the final model as the
    mean of the last ``final_average`` globals, and the inner first ``moments`` averaged
    (``off``, ``every_round``, ``every_n`` = every ``moments_every``-th global)."""

    kind: str
    lr: float
    momentum: float
    adaptive_c: float
    adaptive_max: float
    final_average: int
    moments: str
    moments_every: int

    def syncs_moments(self, outer_step: int) -> bool:
        """Whether the round that makes global ``outer_step`` averages the first moments."""
        return syncs_momentum(self.moments, self.moments_every, outer_step)


@dataclasses.dataclass(frozen=True)
class RoundSettings:
    """What the node, its link, the master and a relay read of the ``distributed`` section,
    built once (:meth:`of`) by the coordinator and handed to each."""

    rules: RoundRules
    wire: WireFormat
    outer: OuterRule

    @classmethod
    def of(cls, config: DistributedConfig) -> RoundSettings:
        """The section's round rules, wire format and outer rule."""
        c = config
        rules = RoundRules(
            c.inner_steps, c.sync, c.round_timeout, c.poll_interval, c.min_nodes,
            c.expected_nodes, c.max_staleness, c.drop_after, tuple(c.relay_leaders),
            c.sync == "overlapped" and c.async_delta_upload, c.delta_upload_shutdown_timeout,
            c.reset_inner_optimizer, *c.liveness, c.fragments, _overlap_steps(c),
        )  # fmt: skip
        wire = WireFormat(c.delta_dtype, c.delta_block_size, c.global_dtype, c.error_feedback)
        outer = OuterRule(
            c.outer_step, c.outer_lr, c.outer_momentum, c.adaptive_c, c.adaptive_max,
            c.final_average, c.sync_inner_momentum, c.inner_momentum_every,
        )  # fmt: skip
        return cls(rules, wire, outer)

    @property
    def updates_follow(self) -> bool:
        """Whether a global may come as an outer update of the one before (a node keeps the
        global it holds to apply it): an int8/int4 global, or an fp32 one of streamed rounds
        (the new values of the round's fragment)."""
        return self.wire.global_dtype != "fp32" or self.rules.fragments > 1


def _overlap_steps(config: DistributedConfig) -> int:
    """``sync: overlapped``: ``overlap_steps``; null: a tenth of ``inner_steps`` (at least 1:
    each stale step costs quality, a tenth of a tensor's period measured within 1% of
    blocking, docs/diloco.md); blocking: 0."""
    if config.sync != "overlapped":
        return 0
    return config.overlap_steps or max(1, config.inner_steps // 10)


def max_global_bytes(like: Mapping[str, torch.Tensor]) -> int:
    """The largest global file a model shaped and typed as ``like`` can have (+ 1 MiB)."""
    return sum(v.numel() * v.element_size() for v in like.values()) + (1 << 20)


def max_moments_bytes(like: Mapping[str, torch.Tensor]) -> int:
    """The largest mean first moments file (:data:`GLOBAL_MOMENTS`) of a model shaped as
    ``like``: float32 values of its floating tensors (+ 1 MiB)."""
    return 4 * sum(v.numel() for v in like.values() if v.is_floating_point()) + (1 << 20)


@dataclasses.dataclass(frozen=True)
class GlobalMetadata:
    """Version record of the published global model (``global/step_count.json``).

    ``final`` is true on the global the master published after the last round of a run;
    ``run_id`` names the run (a new one each time a master starts a run from global 0), so
    a node can tell a new run from the next round and the master can refuse contributions
    computed in another run. ``update_sha256`` names the quantized outer update to this
    global (``distributed.global_dtype``; :mod:`.master`); ``chain`` the updates after the
    weights file when that file is an older global (of outer step ``outer_step - len(chain)``;
    ``sha256`` is the file's), each at ``update_path(k)``: the file and the chain make this one.
    ``refused`` names the contributions (``node/round``) the master refused as unreadable
    or damaged since the previous global: how a node hears that its file was not used.
    ``mean_digest`` marks a final global that is the mean of the last two globals and has
    no weights file of its own: the weights file and the chain make the last of them (the
    one before it is the file with the chain but its last update), and the mean of the two
    has this :func:`.codec.state_digest`.
    """

    outer_step: int
    updated_at: str
    model_file: str = GLOBAL_MODEL
    sha256: str = ""
    final: bool = False
    run_id: str = ""
    update_sha256: str = ""
    refused: tuple[str, ...] = ()
    chain: tuple[str, ...] = ()  # sha256 of the updates after the weights file, oldest first
    # a final global that is the mean of the last two: sha256 of the update (at
    # update_path(outer_step)) that made the last of them from global outer_step - 1
    mean_update: str = ""
    mean_digest: str = ""  # the final mean made from the chain, not written (see above)

    def names(self, outer_step: int, run_id: str) -> bool:
        """Whether this record is of global ``outer_step`` of run ``run_id``."""
        return (self.outer_step, self.run_id) == (outer_step, run_id)

    def updates_after(self, outer_step: int) -> list[tuple[int, str]] | None:
        """``(outer step, sha256)`` of the published updates that lead from global
        ``outer_step`` to this one, oldest first; None when none do (none makes a final
        mean: :attr:`mean_digest`)."""
        if self.mean_digest:
            return None
        return self.chain_after(outer_step)

    def chain_after(self, outer_step: int) -> list[tuple[int, str]] | None:
        """:meth:`updates_after`; of a final mean record, the updates that lead to the last
        global of its chain (the mean is made from the last two)."""
        first = self.outer_step - len(self.chain) + 1  # the first update of the chain
        if self.chain and first <= outer_step + 1 <= self.outer_step:
            return [(k, self.chain[k - first]) for k in range(outer_step + 1, self.outer_step + 1)]
        if self.update_sha256 and outer_step == self.outer_step - 1:
            return [(self.outer_step, self.update_sha256)]
        return None

    def to_dict(self) -> dict[str, object]:
        """Core keys (sha256 only when known, final only when true)."""
        out: dict[str, object] = {
            "outer_step": self.outer_step,
            "updated_at": self.updated_at,
            "model_file": self.model_file,
        }
        optional = {
            "model_sha256": self.sha256,
            "final": self.final,
            "run_id": self.run_id,
            "update_sha256": self.update_sha256,
            "refused": list(self.refused),
            "chain_sha256": list(self.chain),
            "mean_update_sha256": self.mean_update,
            "mean_digest": self.mean_digest,
        }
        out.update((key, value) for key, value in optional.items() if value)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Json]) -> GlobalMetadata:
        """Parse a record; the legacy key ``step`` is accepted for ``outer_step``."""
        return cls(
            outer_step=int(data.get("outer_step", data.get("step", 0))),
            updated_at=str(data.get("updated_at", "")),
            model_file=str(data.get("model_file", GLOBAL_MODEL)),
            sha256=str(data.get("model_sha256", "")),
            final=str(data.get("final", "false")).lower() == "true",
            run_id=str(data.get("run_id", "")),
            update_sha256=str(data.get("update_sha256", "")),
            refused=_refused(data.get("refused")),
            chain=tuple(str(x) for x in data.get("chain_sha256") or () if isinstance(x, str)),
            mean_update=str(data.get("mean_update_sha256", "")),
            mean_digest=str(data.get("mean_digest", "")),
        )


def _refused(value: Json) -> tuple[str, ...]:
    """The well-formed ``node/round`` names of a record's ``refused`` list."""
    out = []
    for item in value if isinstance(value, list) else []:
        node, _, round = str(item).partition("/")
        if parse_delta_path(f"nodes/{node}/delta_{round}.safetensors") is not None:
            out.append(f"{node}/{round}")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """What a listing says about one file: size in bytes and a version that changes when the
    content does (the Hub's blob id; size and mtime on a shared volume); None when unknown."""

    size: int | None = None
    version: str | None = None


@dataclasses.dataclass
class RepoScan:
    """One listing of the repository: contribution files and node records by node, and what
    the listing says about every file."""

    deltas: dict[str, dict[int, str]] = dataclasses.field(default_factory=dict)
    owners: set[str] = dataclasses.field(default_factory=set)
    files: dict[str, FileInfo] = dataclasses.field(default_factory=dict)

    def size(self, path: str) -> int | None:
        """The listed size of ``path`` (None: unknown)."""
        info = self.files.get(path)
        return info.size if info is not None else None


# -- the Store protocol ---------------------------------------------------------------------
@runtime_checkable
class Store(Protocol):
    """The exchange as the node, the master, the relay and ``speedtronic eval`` use it: the
    layout above, written here once over six primitives (the first six methods) that a store
    implements: :class:`RepoTransport` and its directory and Hub stores.

    Every call is retried by :attr:`retry` (transient failures only) and fails as a
    :class:`TransportError`: ``kind`` ``transient`` (an outage that outlived the retries),
    ``not_found`` (:class:`RemoteNotFound`) or ``permanent`` (a refused file, an access error
    (:class:`AccessRefused`), a misconfiguration); messages never carry the token.
    """

    #: ``directory`` or ``hub``.
    kind: str
    #: ``file:///abs/path`` or ``owner/name``.
    repo_id: str
    #: The one retry policy of this store (``on_retry`` may be set by the owner).
    retry: RetryPolicy
    #: Commits this process issued (Hub budget accounting).
    commits: int
    #: Size in bytes of the last contribution file this process uploaded.
    last_upload_bytes: int
    #: Where uploads are staged before they are sent (None: the temporary directory).
    staging_dir: Path | None
    #: The last version record this process published (a publish builds on it).
    published: GlobalMetadata | None
    #: How many models the updates after that record's weights file cover (see
    #: :data:`FULL_GLOBAL_EVERY`).
    chain_models: float
    #: The weights file of :attr:`published`'s chain still on its way (``weights_later``).
    weights_upload: WeightsUpload | None

    def create_repo(self, *, private: bool = True) -> None:
        """Create the exchange (private by default); an existing one is accepted."""
        ...

    def add_collaborator(self, username: str, permission: str = "write") -> None:
        """Grant ``permission`` (read, write, admin) to ``username`` where the backend can."""
        ...

    def list_info(self) -> dict[str, FileInfo]:
        """Every file of the exchange with its size and version (links never listed)."""
        ...

    def read_bytes(self, path: str, *, max_bytes: int | None = None) -> bytes | None:
        """The content of ``path``, None when it does not exist; longer than ``max_bytes``
        is a permanent error, checked on the bytes read."""
        ...

    def local_copy(
        self, path: str, max_bytes: int | None = None
    ) -> contextlib.AbstractContextManager[Path]:
        """A local file holding exactly the bytes of ``path`` for the ``with`` block, at most
        ``max_bytes`` long (checked on the file opened or downloaded, a permanent error);
        a missing file is :class:`RemoteNotFound`."""
        ...

    def commit(
        self,
        additions: Additions,
        deletions: Iterable[str] = (),
        message: str = "update",
        *,
        background: bool = False,
    ) -> None:
        """Apply additions (in order; bytes, or a staged local file read as it is sent) and
        deletions as one unit: one Hub commit, or temp file + rename per file on a volume, so
        no reader sees half a file. Deletion targets already gone are fine. ``background``:
        the Hub store sends its files giving way to this process's other uploads
        (:data:`~speedtronic.diloco.hub.UPLINK`); a volume writes at once."""
        ...

    # -- the layout, over the primitives ------------------------------------------------------
    def list_files(self) -> list[str]:
        """Every file path of the exchange, sorted."""
        return sorted(self.list_info())

    def file_exists(self, path: str) -> bool:
        """Whether ``path`` exists (2.0.0; a listing)."""
        return path in set(self.list_files())

    def read_json(self, path: str, *, default: Json = None) -> Json:
        """``path`` decoded as JSON, ``default`` when absent; bad JSON is permanent."""
        data = self.read_bytes(path)
        if data is None:
            return default
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TransportError(f"{path} is not valid JSON: {exc}", kind="permanent") from None

    def global_metadata(self) -> GlobalMetadata | None:
        """The published version record (``global/step_count.json``), None before the
        bootstrap."""
        data = self.read_json(GLOBAL_STEP)
        return GlobalMetadata.from_dict(data) if isinstance(data, dict) else None

    def read_global(self, metadata: GlobalMetadata | None = None) -> dict[str, torch.Tensor]:
        """The verified global weights (:meth:`fetch_global` without bounds)."""
        return self.fetch_global(metadata)[1]

    def fetch_global(
        self,
        metadata: GlobalMetadata | None = None,
        *,
        max_bytes: int | None = None,
        like: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[GlobalMetadata, dict[str, torch.Tensor]]:
        """The global named by ``metadata`` (default: the published record), verified, with
        the record that describes it.

        ``max_bytes`` refuses a larger file (checked on the file read). The weights must
        match the record's checksum; when they do not, the file's own header (outer step, run
        id, written by :meth:`publish_global`) is trusted if it is at least as new as the
        record: a publish torn between its files. With ``like`` (the model's state), the
        global must hold exactly its keys with its shapes, and every floating tensor must be
        finite as it will be installed (cast to ``like``'s dtype); without it, finite in the
        file's dtype. A weights file of an older global (the record's ``chain``) is brought to
        this one with the updates after it (:meth:`apply_updates`). Refusals are permanent
        ``TransportError``s.
        """
        metadata = metadata or self.global_metadata()
        if metadata is None:
            raise RemoteNotFound(f"{GLOBAL_STEP} is missing")
        model_file = metadata.model_file
        if not (model_file.startswith("global/") and model_file.endswith(".safetensors")):
            raise TransportError(
                f"refusing model_file outside global/: {model_file}", kind="permanent"
            )
        metadata, state = self._read_weights(metadata, max_bytes)
        where = f"{model_file} (outer step {metadata.outer_step})"
        if like is not None:
            _check_like(where, state, like)
        if metadata.chain:  # an older global: the published updates after it make this one
            first = HeldGlobal.of(metadata.outer_step - len(metadata.chain), metadata.run_id, state)
            try:
                model = like if like is not None else state
                state = self._walk_chain(metadata, first, like=model, max_bytes=max_bytes)
            except (ValueError, RemoteNotFound) as exc:
                raise TransportError(f"{where}: {exc}", kind="permanent") from None
        bad = first_non_finite(state, like=like)
        if bad is not None:
            cast = like is not None and bad in like and like[bad].dtype != state[bad].dtype
            after = f" after the cast to the model's {like[bad].dtype}" if like and cast else ""
            raise TransportError(
                f"{where} holds non-finite values in {bad}{after}; refusing it", kind="permanent"
            )
        return metadata, state

    def _read_weights(
        self, metadata: GlobalMetadata, max_bytes: int | None
    ) -> tuple[GlobalMetadata, dict[str, torch.Tensor]]:
        """The weights file ``metadata`` names and the record that describes it: ``metadata``,
        or the file's own header when a publish was torn between its files."""
        model_file = metadata.model_file
        try:  # the file read as it lies on disk: its bytes are never all in memory at once
            with self.local_copy(model_file, max_bytes=max_bytes) as local:
                digest = file_sha256(local)
                with open_safetensors(local) as opened:
                    header = opened.metadata()
                    state = {key: opened.get_tensor(key) for key in opened}
        except RemoteNotFound:
            raise RemoteNotFound(f"{model_file} is missing") from None
        except ValueError as exc:
            raise TransportError(f"{model_file} is corrupt: {exc}") from None
        if metadata.sha256 and digest != metadata.sha256:
            own = _own_record(header, metadata, digest)
            if own is None:
                raise TornRead(
                    f"{model_file} does not match step_count.json (changed while reading)"
                )
            metadata = own
        return metadata, state

    def download_global(
        self, local_path: str | Path, metadata: GlobalMetadata | None = None
    ) -> Path:
        """2.0.0 form: write the verified global weights to ``local_path`` and return it."""
        return save_safetensors(self.read_global(metadata), local_path)

    def announce(self, state: Mapping[str, torch.Tensor], *, run_id: str) -> GlobalMetadata:
        """Write :data:`GLOBAL_START`, the record global 0 of run ``run_id`` over ``state`` will
        have (the sha256 of its weights file, computed here; nothing of the weights is sent),
        and return it."""
        made = GlobalMetadata(0, datetime.now(timezone.utc).isoformat(), run_id=str(run_id))
        made = dataclasses.replace(
            made, sha256=safetensors_sha256(state, metadata=weights_header(made))
        )
        self.commit({GLOBAL_START: _json_bytes(made.to_dict())}, message="run start")
        return made

    def announced(self) -> GlobalMetadata | None:
        """The run announced in :data:`GLOBAL_START` (global 0 of a run, with its sha256), or
        None (none, or not such a record)."""
        data = self.read_json(GLOBAL_START, default=None)
        if not isinstance(data, dict):
            return None
        try:
            record = GlobalMetadata.from_dict(data)
        except (TypeError, ValueError):
            return None
        plain = record.outer_step == 0 and not (record.final or record.chain)
        return record if plain and record.sha256 and record.run_id else None

    def read_ledger(self) -> dict[str, int]:
        """The published ledger: node id -> highest round already aggregated. A ledger in
        another format (2.0.0 wrote a list of consumed files) reads as empty."""
        book = self.read_json(GLOBAL_PROCESSED, default={})
        return _by_node(book.get("nodes") if isinstance(book, dict) else None, int)

    def read_node_records(self) -> dict[str, dict[str, Json]]:
        """What the published ledger's record says of each node beside its round: ``finals``
        (node -> round of its aggregated contribution flagged final), ``instances`` (node ->
        the instance of its last aggregated contribution), ``digests`` (node -> its sha256)
        and ``dropped`` (node -> the instance the master no longer waits for); empty maps
        in a record written before they were published."""
        book = self.read_json(GLOBAL_PROCESSED, default={})
        found = book if isinstance(book, dict) else {}
        return {name: _by_node(found.get(name), kind) for name, kind in NODE_RECORDS.items()}

    def publish_global(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        outer_step: int,
        ledger: Mapping[str, int] | None = None,
        prune: Iterable[str] = (),
        metadata_extra: Mapping[str, object] | None = None,
        final: bool = False,
        run_id: str = "",
        node_records: Mapping[str, Mapping[str, object]] | None = None,
        updated_at: str | None = None,
        work_dir: object = None,
        update: OuterUpdate | None = None,
        refused: Iterable[str] = (),
        moments: Mapping[str, torch.Tensor] | None = None,
        weights: bool = True,
        last_update: OuterUpdate | None = None,
        mean_of_two: bool = False,
        weights_later: bool = False,
    ) -> GlobalMetadata:
        """One commit: the weights, the quantized outer ``update`` and the mean first
        ``moments`` (:data:`GLOBAL_MOMENTS`) if given, the ledger (with
        ``node_records`` beside it) and the version record, in that order (the record names
        the ``refused`` contributions, ``node/round``), and the deletion of ``prune``;
        returns the record published. ``work_dir`` (2.0.0) is accepted and unused.

        Of the weights it sends the least the last record this store published
        (:attr:`published`) allows: nothing when ``weights`` is false and that record names
        this global (a run marked final); only ``update`` when it turns that record's global
        into this one and the updates after the weights file cover fewer than
        :data:`FULL_GLOBAL_EVERY` models; else the weights file (the updates it replaces
        pruned), with ``last_update`` beside it when given (a final global that is the mean
        of the last two: the update that made the last, ``mean_update`` in the record).
        A final ``state`` that is the mean of the last two globals (``mean_of_two``) sends
        no weights file when the exchange can make it (:meth:`_mean_record`).
        With ``weights_later`` a weights file goes after the commit (:class:`WeightsUpload`);
        a publish that writes one, and a final one, waits for it first."""
        del work_dir
        self._settle_weights(wait=final)
        now = updated_at or datetime.now(timezone.utc).isoformat()
        made = GlobalMetadata(int(outer_step), now, final=bool(final), run_id=str(run_id))
        made = dataclasses.replace(made, refused=tuple(refused))
        files: dict[str, bytes | Path] = {}
        with contextlib.ExitStack() as stack:

            def stage(path: str, write: Callable[[BinaryIO], str]) -> str:
                local, handle = stack.enter_context(_staged(self.staging_dir, "staged"))
                digest = write(handle)
                handle.close()
                files[path] = local
                return digest

            sends = Sends(update, weights, last_update, mean_of_two)
            meta, stale, covered = self._weights(made, state, sends, stage)
            later = self._weights_after(files, stale) if weights_later else None
            if moments is not None:
                head = {"outer_step": str(made.outer_step)}
                stage(GLOBAL_MOMENTS, lambda h: write_safetensors(h, moments, metadata=head))
            record: dict[str, object] = {str(k): str(v) for k, v in (metadata_extra or {}).items()}
            record.update(meta.to_dict(), processed_file=GLOBAL_PROCESSED)
            files[GLOBAL_PROCESSED] = _json_bytes(_book(meta.outer_step, ledger, node_records))
            files[GLOBAL_STEP] = _json_bytes(record)
            self._commit_before(later, files, [*prune, *stale], f"outer step {meta.outer_step}")
        self.published, self.chain_models = meta, covered
        if later is not None:
            self.weights_upload = WeightsUpload(self, later, meta)
        return meta

    def _weights_after(self, files: dict[str, bytes | Path], stale: list[str]) -> Path | None:
        """The weights file staged in ``files``, taken out of the commit to go after it (None:
        none staged); another run's weights file is deleted by the commit (``stale``), so no
        reader takes it for this one meanwhile."""
        staged = files.pop(GLOBAL_MODEL, None)
        if staged is None:
            return None
        if GLOBAL_MODEL in self.list_info():
            stale.append(GLOBAL_MODEL)
        return _kept(staged)

    def _commit_before(
        self, later: Path | None, files: Additions, deletions: list[str], message: str
    ) -> None:
        """:meth:`commit`; the weights file ``later`` that was to follow it is removed when it
        fails."""
        try:
            self.commit(files, deletions, message=message)
        except BaseException:
            if later is not None:
                shutil.rmtree(later.parent, ignore_errors=True)
            raise

    def _settle_weights(self, *, wait: bool) -> None:
        """Forget a weights upload that ended (``wait``: wait for it first); after a failed
        one the next publish writes a weights file of its own, as a restarted master does."""
        upload = self.weights_upload
        if upload is None or (upload.running and not wait):
            return
        if not upload.wait():
            self.published, self.chain_models = None, 0.0
        self.weights_upload = None

    def _weights(
        self,
        made: GlobalMetadata,
        state: Mapping[str, torch.Tensor],
        sends: Sends,
        stage: Callable[[str, Callable[[BinaryIO], str]], str],
    ) -> tuple[GlobalMetadata, list[str], float]:
        """What a publish sends of global ``made`` (``stage(path, write)`` adds a file to the
        commit): its record, the update files it leaves without use (see publish_global) and
        how many models the updates after its weights file cover (:data:`FULL_GLOBAL_EVERY`)."""
        update, weights, last_update = sends.update, sends.weights, sends.last_update
        if sends.mean_of_two and made.final and update is None:
            mean = self._mean_record(made, state, last_update, stage)
            if mean is not None:
                return mean[0], [], mean[1]
        last, step, run = self.published, made.outer_step, made.run_id
        covered = self.chain_models if last is not None else 0.0
        if last is not None and not weights and update is None and last.names(step, run):
            new = dataclasses.replace(last, updated_at=made.updated_at, final=made.final)
            return dataclasses.replace(new, refused=made.refused), [], covered  # the record only
        if (  # the update makes it from the last record's global (a final mean is no base)
            update is not None
            and last is not None
            and last.names(update.base_step, run)
            and not last.mean_digest
        ):
            grown = covered + update_share(update, state)
            if grown < FULL_GLOBAL_EVERY - 1e-9:  # the weights file stays: +1 update
                sha = stage(update_path(step), update.write)
                meta = dataclasses.replace(made, update_sha256=sha, chain=(*last.chain, sha))
                return dataclasses.replace(meta, sha256=last.sha256), [], grown
        self._settle_weights(wait=True)  # never an older weights file over this one
        last = self.published  # None after a failed one
        header = weights_header(made)
        sha = stage(GLOBAL_MODEL, lambda h: write_safetensors(h, state, metadata=header))
        up = "" if update is None else stage(update_path(step), update.write)
        made = dataclasses.replace(made, sha256=sha, update_sha256=up)
        if last_update is not None and update is None:  # beside a final mean of the last two
            made = dataclasses.replace(
                made, mean_update=stage(update_path(step), last_update.write)
            )
        return made, self._stale_updates(last), 0.0

    def _mean_record(
        self,
        made: GlobalMetadata,
        state: Mapping[str, torch.Tensor],
        last_update: OuterUpdate | None,
        stage: Callable[[str, Callable[[BinaryIO], str]], str],
    ) -> tuple[GlobalMetadata, float] | None:
        """The record of the final global ``made``, the mean of the last two globals, with no
        weights file: the last weights file and its chain make the last global (with
        ``last_update``, staged here, the one it made from the last record's; without, the
        last record's own), the chain without its last update the one before, and the
        record names the mean's digest (:attr:`GlobalMetadata.mean_digest`). None when the
        one before is not on the exchange (the last record is a weights file of its own),
        the updates would pass :data:`FULL_GLOBAL_EVERY` models, or this store published
        nothing yet (a restarted master): the weights file is written as before."""
        last, step, run = self.published, made.outer_step, made.run_id
        if last is None or last.mean_digest or last.run_id != run:
            return None
        covered = self.chain_models
        if last_update is not None:  # the last round made global `step` with last_update
            if not last.names(last_update.base_step, run) or last_update.outer_step != step:
                return None
            covered += update_share(last_update, state)
            if covered >= FULL_GLOBAL_EVERY - 1e-9:
                return None
            sha = stage(update_path(step), last_update.write)
            chain = (*last.chain, sha)
        elif last.names(step, run) and last.chain:  # every node done after global `step`
            chain, sha = last.chain, last.chain[-1]
        else:
            return None
        meta = dataclasses.replace(
            made,
            sha256=last.sha256,
            chain=chain,
            update_sha256=sha,
            mean_update=sha,
            mean_digest=state_digest(state),
        )
        return meta, covered

    def _stale_updates(self, last: GlobalMetadata | None) -> list[str]:
        """The update files a new weights file leaves without use: the ones ``last`` names, or
        every one listed when this process has published nothing yet."""
        if last is None:
            return [p for p in self.list_files() if p.startswith("global/update")]
        one = bool(last.update_sha256 or last.mean_update)
        first = last.outer_step + 1 - max(len(last.chain), int(one))
        return [update_path(k) for k in range(first, last.outer_step + 1)]

    def apply_updates(
        self,
        metadata: GlobalMetadata,
        held: HeldGlobal,
        *,
        like: Mapping[str, torch.Tensor],
        max_bytes: int | None = None,
    ) -> tuple[HeldGlobal, int]:
        """Global ``metadata`` from ``held`` and the published updates after it (each checked
        by :func:`.codec.read_update`, read within ``max_bytes``), and the bytes read.
        ``ValueError`` when no published update leads from ``held`` or one is unusable."""
        steps = metadata.updates_after(held.outer_step)
        if held.run_id != metadata.run_id:
            steps = None
        made = list(self._updated(steps, held, like, max_bytes))
        return made[-1][0], sum(size for _, size in made)

    def _updated(
        self,
        steps: list[tuple[int, str]] | None,
        held: HeldGlobal,
        like: Mapping[str, torch.Tensor],
        max_bytes: int | None,
    ) -> Iterator[tuple[HeldGlobal, int]]:
        """Each global the published updates ``steps`` make from ``held``, in turn, with the
        size of its update file; ``ValueError`` when there are none or one is unusable."""
        if not steps:
            raise ValueError(f"no published update applies to global {held.outer_step}")
        for step, sha256 in steps:
            with self.local_copy(update_path(step), max_bytes=max_bytes) as local:
                size = local.stat().st_size
                held = read_update(
                    local, held, sha256=sha256, outer_step=step, run_id=held.run_id, like=like
                )
            yield held, size

    def _walk_chain(
        self,
        metadata: GlobalMetadata,
        first: HeldGlobal,
        *,
        like: Mapping[str, torch.Tensor],
        max_bytes: int | None,
    ) -> dict[str, torch.Tensor]:
        """The global ``metadata`` names from its weights file (``first``) and its chain: the
        last global the chain makes, or for a final mean record the mean of the last two,
        which must have the record's digest (``ValueError`` otherwise)."""
        steps = metadata.chain_after(first.outer_step)
        made = [first, *(held for held, _ in self._updated(steps, first, like, max_bytes))]
        if not metadata.mean_digest:
            return made[-1].state
        mean = average_states([made[-2].state, made[-1].state])
        if state_digest(mean) != metadata.mean_digest:
            raise ValueError("the mean of the last two globals differs from the master's (digest)")
        return mean

    def upload_delta(
        self,
        delta: Mapping[str, torch.Tensor | QuantizedTensor],
        *,
        node_id: str,
        local_step: int,
        base_outer_step: int,
        round_index: int | None = None,
        dtype: str = "fp32",
        metadata: Mapping[str, object] | None = None,
        owner: Mapping[str, object] | None = None,
        work_dir: object = None,
        block_size: int | None = None,
    ) -> str:
        """One commit: the node's contribution to round ``round_index`` (default: the base
        outer step) as ``nodes/<node>/delta_<round>.safetensors``, with its status record
        ``owner`` when given, in wire format ``dtype`` (int8/int4: blocks of ``block_size``
        values; values may come already quantized, see :func:`.codec.encode_delta`). Returns
        the path; the size is left in :attr:`last_upload_bytes`. ``work_dir`` (2.0.0) is
        accepted and unused."""
        del work_dir
        target = int(base_outer_step if round_index is None else round_index)
        path = delta_path(node_id, target)
        with _staged(self.staging_dir, "delta.safetensors") as (staged, handle):
            write_delta(  # one tensor at a time: never the whole file in memory
                handle,
                delta,
                node_id=node_id,
                local_step=local_step,
                base_outer_step=base_outer_step,
                round_index=target,
                dtype=dtype,
                extra={k: v for k, v in (metadata or {}).items() if k != "algorithm"},
                block_size=block_size,
            )
            handle.close()
            additions: dict[str, bytes | Path] = {path: staged}
            if owner is not None:
                additions[f"nodes/{node_id}/owner.json"] = _json_bytes(dict(owner))
            self.commit(additions, message=f"delta {node_id} round {target}")
            self.last_upload_bytes = staged.stat().st_size
        return path

    def scan(self) -> RepoScan:
        """One listing: contributions ``{node: {round: path}}``, the nodes with a record, and
        every file's size."""
        scan = RepoScan(files=self.list_info())
        for path in sorted(scan.files):
            parsed = parse_delta_path(path)
            parts = path.split("/")
            owner = len(parts) == 3 and parts[0] == "nodes" and parts[2] == "owner.json"
            if parsed is not None:
                scan.deltas.setdefault(parsed[0], {})[parsed[1]] = path
            elif owner and is_valid_node_id(parts[1]):
                scan.owners.add(parts[1])
        return scan

    def delta_paths(self) -> list[str]:
        """Every well-formed delta path, sorted."""
        return [p for p in self.list_files() if parse_delta_path(p) is not None]

    def read_delta(self, path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """One contribution as float32 tensors and its header (damage is a ValueError)."""
        data = self.read_bytes(path)
        if data is None:
            raise RemoteNotFound(f"{path} vanished")
        return delta_from_bytes(data)

    def prune(self, paths: Iterable[str]) -> None:
        """Delete consumed files in one commit (files already gone are fine)."""
        self.commit({}, list(paths), message="prune consumed deltas")

    def read_owner(self, node_id: str) -> dict[str, Json] | None:
        """The status record of ``node_id``; None when absent or unreadable."""
        try:
            data = self.read_json(f"nodes/{node_id}/owner.json")
        except TransportError as exc:
            if exc.kind == "permanent":
                return None
            raise
        return data if isinstance(data, dict) else None

    def claim_owner(self, node_id: str, record: Mapping[str, object]) -> None:
        """Write the status record of ``node_id`` (one commit)."""
        self.commit(
            {f"nodes/{node_id}/owner.json": _json_bytes(dict(record))}, message=f"claim {node_id}"
        )

    def write_beat(self, node_id: str, beat: Mapping[str, object]) -> None:
        """Write the liveness beat of ``node_id`` (one commit; its content changes each time)."""
        self.commit({beat_path(node_id): _json_bytes(dict(beat))}, message=f"beat {node_id}")


#: 2.0.0 name of :class:`Store`.
Transport = Store


def too_large(path: str, size: int, max_bytes: int) -> TransportError:
    """The permanent refusal of a file past its size bound (checked on what is read)."""
    return TransportError(
        f"{path} is {size} bytes, more than the {max_bytes} bytes allowed for it (a file from "
        "another model, or damaged); refusing it unread",
        kind="permanent",
    )


def _own_record(
    header: Mapping[str, str], record: GlobalMetadata, digest: str
) -> GlobalMetadata | None:
    """The global file's own description when it is at least as new as ``record``."""
    try:
        step = int(header["outer_step"])
    except (KeyError, ValueError):
        return None
    if step < record.outer_step:
        return None
    final, run_id = header.get("final", "False") == "True", header.get("run_id", "")
    return GlobalMetadata(step, record.updated_at, record.model_file, digest, final, run_id)


def _check_like(
    where: str, state: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]
) -> None:
    """A global must hold exactly the model's keys with its shapes (permanent refusal)."""
    missing, extra = sorted(set(like) - set(state)), sorted(set(state) - set(like))
    if missing or extra:
        raise TransportError(
            f"{where} does not match the model: missing {missing[:5]}, unexpected "
            f"{extra[:5]} (a global of another model; check model settings on every node)",
            kind="permanent",
        )
    for key, value in state.items():
        if value.shape != like[key].shape:
            raise TransportError(
                f"{where} does not match the model: {key} has shape {tuple(value.shape)}, "
                f"the model {tuple(like[key].shape)}",
                kind="permanent",
            )


def _book(
    outer_step: int,
    ledger: Mapping[str, int] | None,
    node_records: Mapping[str, Mapping[str, object]] | None,
) -> dict[str, object]:
    """``global/processed.json``: the ledger, and what the master knows of each node beside
    its round (:data:`NODE_RECORDS`)."""
    book: dict[str, object] = {
        "outer_step": outer_step,
        "nodes": dict(sorted((ledger or {}).items())),
    }
    for name, values in (node_records or {}).items():
        if name in NODE_RECORDS:
            book[name] = dict(sorted(values.items()))
    return book


def _by_node(found: Json, kind: type) -> dict[str, Json]:
    """The entries of a ledger map whose key is a valid node id and whose value a ``kind``."""
    return {
        str(node): value
        for node, value in (found if isinstance(found, dict) else {}).items()
        if is_valid_node_id(str(node)) and isinstance(value, kind) and not isinstance(value, bool)
    }


def _json_bytes(value: object) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _kept(staged: bytes | Path) -> Path:
    """A staged file moved into a folder of its own, kept past the publish's staging (the
    caller removes the folder)."""
    assert isinstance(staged, Path)
    folder = Path(tempfile.mkdtemp(prefix="speedtronic-later-", dir=staged.parent.parent))
    return Path(shutil.move(staged, folder / staged.name))


@contextlib.contextmanager
def _staged(directory: Path | None, name: str) -> Iterator[tuple[Path, BinaryIO]]:
    """A local file to write an upload into (under ``directory``), removed after."""
    with tempfile.TemporaryDirectory(prefix="speedtronic-stage-", dir=directory) as tmp:
        path = Path(tmp) / name
        with open(path, "wb") as handle:
            yield path, handle


# -- the shared implementation ------------------------------------------------------------
class RepoTransport(Store):
    """The :class:`Store` primitives over five raw operations a backend implements, each
    attempt run through :meth:`_scoped` and retried by :attr:`retry`: ``_create_repo``,
    ``_grant``, ``_list``, ``_read`` (a missing file raises a not-found error) and
    ``_commit(additions, deletions, message)``, which applies all of its operations as one
    unit."""

    kind = "abstract"

    def __init__(self, repo_id: str, retry: RetryPolicy | None = None):
        if not repo_id:
            raise ValueError("repo_id is required")
        self.repo_id = repo_id
        self.retry = retry or RetryPolicy()
        self.commits = 0
        self.staging_dir: Path | None = None
        self.last_upload_bytes = 0
        self.published: GlobalMetadata | None = None
        self.chain_models = 0.0
        self.weights_upload: WeightsUpload | None = None

    def _create_repo(self, private: bool) -> None:
        raise NotImplementedError

    def _grant(self, username: str, permission: str) -> None:
        raise NotImplementedError

    def _list(self) -> dict[str, FileInfo]:
        raise NotImplementedError

    def _read(self, path: str, max_bytes: int | None) -> bytes:
        raise NotImplementedError

    def _commit(self, additions: Additions, deletions: list[str], message: str) -> None:
        raise NotImplementedError

    def _attempt(self, fn: Callable[[], R]) -> R:
        """One attempt of an operation (the Hub store bounds it by its deadline)."""
        return fn()

    def _lane(self, background: bool) -> contextlib.AbstractContextManager[None]:
        """Where a commit's attempts send their files: a volume writes at once (the Hub store
        lets a ``background`` one give way to the process's other uploads)."""
        del background
        return contextlib.nullcontext()

    def _run(self, operation: str, fn: Callable[[], R]) -> R:
        return self.retry.run(operation, lambda: self._attempt(fn))

    # the primitives of the Store (their documentation is the Store's)
    def create_repo(self, *, private: bool = True) -> None:
        self._run("create repository", lambda: self._create_repo(private))

    def add_collaborator(self, username: str, permission: str = "write") -> None:
        if permission not in {"read", "write", "admin"}:
            raise ValueError("permission must be read, write, or admin")
        self._run(
            f"grant {permission} access to {username}", lambda: self._grant(username, permission)
        )

    def list_info(self) -> dict[str, FileInfo]:
        return dict(self._run("list repository files", self._list))

    def read_bytes(self, path: str, *, max_bytes: int | None = None) -> bytes | None:
        try:
            return self._run(f"download {path}", lambda: self._read(path, max_bytes))
        except RemoteNotFound:
            return None

    @contextlib.contextmanager
    def local_copy(self, path: str, max_bytes: int | None = None) -> Iterator[Path]:
        data = self.read_bytes(path, max_bytes=max_bytes)
        if data is None:
            raise RemoteNotFound(f"{path} vanished")
        with tempfile.TemporaryDirectory(prefix="speedtronic-read-") as tmp:
            local = Path(tmp) / "file.safetensors"
            local.write_bytes(data)
            del data
            yield local

    def commit(
        self,
        additions: Additions,
        deletions: Iterable[str] = (),
        message: str = "update",
        *,
        background: bool = False,
    ) -> None:
        adds = dict(additions)
        dels = [p for p in dict.fromkeys(deletions) if p not in adds]
        if not adds and not dels:
            return
        operation = f"commit {message}"
        with self._lane(background):
            try:
                self._run(operation, lambda: self._commit(adds, dels, message))
            except RemoteNotFound:
                if not dels:
                    raise
                # A deletion target is gone (e.g. a retried commit that had landed): drop those.
                present = set(self.list_files())
                dels = [p for p in dels if p in present]
                if not adds and not dels:
                    return
                self._run(operation, lambda: self._commit(adds, dels, message))
        self.commits += 1
