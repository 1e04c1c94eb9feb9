"""The master's round state, its local file, and the record of a round whose publish is in
flight.

:class:`RoundState` is everything a round changes: the outer step, the global weights, the
outer optimizer's momentum, the ledger, and what the master knows about each node's
aggregated contributions. The master holds one; a round works on a :meth:`RoundState.copy`
that replaces it only once its publish landed, so a failed publish leaves nothing to undo.

``<state_dir>/outer_state.safetensors`` is one atomic file: tensors ``global/<key>`` and
``momentum/<key>``; its header holds the outer step, run id, ledger, digests, the nodes'
instances and final rounds and the average round length, so a kill at any point leaves the
previous or the new state.

``<state_dir>/pending_round.json`` is a write-ahead record of the round being published: what
the master will report once the publish landed. A master killed after the exchange applied the
publish but before it logged the round finds the record at its restart; when the published
global is that round's (same run, outer step reached) the round is reported then, so the event
log never misses a round the exchange holds. A record of a publish that did not land is
discarded: its contributions are still on the exchange and the round closes again.

:func:`write_final` writes the run's final global where the trainer's output goes
(``<output_dir>/final``), with the redacted config and what produced it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from speedtronic.checkpoint import atomic_json_dump, atomic_write_bytes
from speedtronic.diloco import tensors as T
from speedtronic.diloco.outer import NesterovOuterOptimizer

__all__ = ["OuterStateStore", "RoundState", "write_final"]

_FORMAT = "speedtronic-outer-state/2"


@dataclass
class RoundState:
    """The master's whole mutable round state (one object: copy it, change the copy, keep it
    once the exchange holds it).

    ``outer_step``: the published global's outer step (= the open round); ``global_state``:
    its weights in the model's dtypes; ``optimizer``: the outer optimizer and its momentum;
    ``run_id``: names the run; ``ledger``: node -> highest round aggregated (or dropped);
    ``digests``: node -> sha256 of its last aggregated contribution (a re-sent copy is refused);
    ``instances``: node -> the ``instance`` header of its last aggregated contribution;
    ``finals``: node -> the round of its aggregated contribution flagged ``final``;
    ``round_seconds``: a moving average of the round lengths (the master's drop limit counts
    in it, so it survives a restart).
    """

    outer_step: int
    global_state: dict[str, torch.Tensor]
    optimizer: NesterovOuterOptimizer
    run_id: str = ""
    ledger: dict[str, int] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    instances: dict[str, str] = field(default_factory=dict)
    finals: dict[str, int] = field(default_factory=dict)
    round_seconds: float = 0.0

    @classmethod
    def new(cls, global_state: dict[str, torch.Tensor], lr: float, momentum: float) -> RoundState:
        """Outer step 0 of a new run over ``global_state`` (kept, not copied)."""
        return cls(0, global_state, NesterovOuterOptimizer(global_state, lr, momentum))

    def copy(self) -> RoundState:
        """A deep copy (tensors cloned): what a round or a reconcile changes."""
        optimizer = NesterovOuterOptimizer({}, self.optimizer.lr, self.optimizer.momentum)
        optimizer.load_state_dict(self.optimizer.state_dict())
        return RoundState(
            self.outer_step,
            T.cpu_state_dict(self.global_state),
            optimizer,
            self.run_id,
            dict(self.ledger),
            dict(self.digests),
            dict(self.instances),
            dict(self.finals),
            self.round_seconds,
        )

    def node_records(self) -> dict[str, dict[str, Any]]:
        """What the published ledger's record carries of each node beside its round (the
        transport's ``NODE_RECORDS``): a master that adopts the published global from it
        knows which nodes finished and which instance they ran as."""
        return {
            "finals": dict(self.finals),
            "instances": dict(self.instances),
            "digests": dict(self.digests),
        }

    def take_node_records(self, records: Mapping[str, Mapping[str, Any]], *, newer: bool) -> None:
        """Merge published ``records`` (see :meth:`node_records`): they replace this state's
        when ``newer`` (the published global was adopted), else they only fill what it lacks
        (an outer state file written before they were kept)."""
        for name, mine in self.node_records().items():
            published = dict(records.get(name) or {})
            merged = {**mine, **published} if newer else {**published, **mine}
            setattr(self, name, merged)

    def adopt(self, state: Mapping[str, torch.Tensor], outer_step: int) -> None:
        """Take a published global (cast to this state's dtypes; other keys and shapes are
        ignored) at ``outer_step``; the momentum starts again from zero."""
        for key, value in state.items():
            mine = self.global_state.get(key)
            if mine is not None and tuple(value.shape) == tuple(mine.shape):
                self.global_state[key] = T.cpu_tensor(value).to(mine.dtype)
        self.outer_step = int(outer_step)
        self.optimizer = NesterovOuterOptimizer(
            self.global_state, self.optimizer.lr, self.optimizer.momentum
        )


class OuterStateStore:
    """Reads and writes one master's files under ``state_dir``."""

    def __init__(self, state_dir: str | os.PathLike):
        self.state_dir = Path(state_dir)

    @property
    def path(self) -> Path:
        """The outer state file."""
        return self.state_dir / "outer_state.safetensors"

    @property
    def pending_path(self) -> Path:
        """The write-ahead record of a round being published."""
        return self.state_dir / "pending_round.json"

    def load(self, like: RoundState) -> RoundState | None:
        """The saved state, its tensors shaped and typed as ``like``'s global and its outer
        optimizer configured as ``like``'s; None when there is none.

        Raises ``ValueError`` (after moving the file aside as ``*.corrupt-<time>``) when the
        file cannot be read or does not match ``like``."""
        if not self.path.exists():
            return None
        try:
            tensors, meta = T.state_from_bytes(self.path.read_bytes())
            if meta.get("format") != _FORMAT:
                raise ValueError(f"unknown format {meta.get('format')!r}")
            glob = {k[7:]: v for k, v in tensors.items() if k.startswith("global/")}
            for key, value in like.global_state.items():
                if key not in glob or tuple(glob[key].shape) != tuple(value.shape):
                    raise ValueError(f"global tensor {key} missing or reshaped")
            optimizer = NesterovOuterOptimizer({}, like.optimizer.lr, like.optimizer.momentum)
            optimizer.load_state_dict(
                {k[9:]: v for k, v in tensors.items() if k.startswith("momentum/")}
            )
            saved = RoundState(
                outer_step=int(meta["outer_step"]),
                global_state={k: glob[k].to(v.dtype) for k, v in like.global_state.items()},
                optimizer=optimizer,
                run_id=str(meta.get("run_id", "")),
                ledger=_json_map(meta["ledger"], int),
                digests=_json_map(meta["digests"], str),
                instances=_json_map(meta.get("instances", "{}"), str),  # absent before 2.2
                finals=_json_map(meta.get("finals", "{}"), int),
                round_seconds=float(meta.get("round_seconds", "0")),  # absent before 2.3
            )
        except Exception as exc:
            self.path.replace(self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}"))
            raise ValueError(f"{type(exc).__name__}: {exc}") from None
        return saved

    def save(self, state: RoundState) -> None:
        """Write the whole state as one atomic file."""
        tensors = {f"global/{k}": v for k, v in state.global_state.items()}
        tensors.update({f"momentum/{k}": v for k, v in state.optimizer.momentum_buffers.items()})
        meta = {
            "format": _FORMAT,
            "outer_step": state.outer_step,
            "run_id": state.run_id,
            "ledger": json.dumps(dict(sorted(state.ledger.items()))),
            "digests": json.dumps(dict(sorted(state.digests.items()))),
            "instances": json.dumps(dict(sorted(state.instances.items()))),
            "finals": json.dumps(dict(sorted(state.finals.items()))),
            "round_seconds": repr(float(state.round_seconds)),
            "updated_at": datetime.now(timezone.utc).isoformat(),
        }
        atomic_write_bytes(T.state_to_bytes(tensors, metadata=meta), self.path)

    def write_pending(self, outer_step: int, run_id: str, report: dict[str, Any]) -> None:
        """Record, before publishing ``outer_step``, what the master will report about it."""
        atomic_json_dump(
            {"outer_step": outer_step, "run_id": run_id, "report": report}, self.pending_path
        )

    def clear_pending(self) -> None:
        """The round was reported (or will close again): forget its record."""
        self.pending_path.unlink(missing_ok=True)

    def take_pending(self, outer_step: int, run_id: str) -> dict[str, Any] | None:
        """The report of a round that was published but never reported, given the global the
        master now holds; None when there is none or its publish did not land. The record is
        removed either way."""
        try:
            record = json.loads(self.pending_path.read_text())
        except (OSError, ValueError):
            record = None
        self.clear_pending()
        if not isinstance(record, dict) or not isinstance(record.get("report"), dict):
            return None
        landed = record.get("run_id") == run_id and isinstance(record.get("outer_step"), int)
        if not landed or record["outer_step"] > outer_step:
            return None
        return record["report"]


def _json_map(text: str, kind: Callable[[Any], Any]) -> dict[str, Any]:
    """A JSON object of the header, its keys as strings and its values as ``kind``."""
    return {str(k): kind(v) for k, v in json.loads(text).items()}


def write_final(
    directory: Path,
    state: Mapping[str, torch.Tensor],
    *,
    meta: Mapping[str, Any],
    run_config: Mapping[str, Any],
) -> None:
    """The final global as ``model.safetensors``, ``run_config`` (redacted) as
    ``config.yaml`` and ``meta`` (outer step, steps behind it, node, ledger) with the time it
    was written as ``meta.json``, each file written atomically."""
    import yaml

    T.save_safetensors(dict(state), directory / "model.safetensors")
    atomic_write_bytes(
        yaml.safe_dump(dict(run_config), sort_keys=False).encode("utf-8"),
        directory / "config.yaml",
    )
    record = {**meta, "written_at": datetime.now(timezone.utc).isoformat()}
    atomic_write_bytes(
        (json.dumps(record, indent=2) + "\n").encode("utf-8"), directory / "meta.json"
    )
