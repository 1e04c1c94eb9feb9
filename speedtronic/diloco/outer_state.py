"""The master's local outer state, and the record of a round whose publish is in flight.

``<state_dir>/outer_state.safetensors`` is one atomic file: tensors ``global/<key>`` and
``momentum/<key>``; its header holds the outer step, run id, ledger and digests, so a kill at
any point leaves the previous or the new state.

``<state_dir>/pending_round.json`` is a write-ahead record of the round being published: what
the master will report once the publish landed. A master killed after the exchange applied the
publish but before it logged the round finds the record at its restart; when the published
global is that round's (same run, outer step reached) the round is reported then, so the event
log never misses a round the exchange holds. A record of a publish that did not land is
discarded: its contributions are still on the exchange and the round closes again.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from speedtronic.checkpoint import atomic_json_dump, atomic_write_bytes
from speedtronic.diloco import tensors as T

__all__ = ["OuterStateStore", "SavedOuterState"]

_FORMAT = "speedtronic-outer-state/2"


@dataclass
class SavedOuterState:
    """What :meth:`OuterStateStore.load` read back."""

    global_state: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    outer_step: int
    run_id: str
    ledger: dict[str, int]
    digests: dict[str, str]


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

    def load(self, like: dict[str, torch.Tensor]) -> SavedOuterState | None:
        """The saved state, its tensors shaped and typed as ``like``; None when there is none.

        Raises ``ValueError`` (after moving the file aside as ``*.corrupt-<time>``) when the
        file cannot be read or does not match ``like``."""
        if not self.path.exists():
            return None
        try:
            tensors, meta = T.state_from_bytes(self.path.read_bytes())
            if meta.get("format") != _FORMAT:
                raise ValueError(f"unknown format {meta.get('format')!r}")
            glob = {k[7:]: v for k, v in tensors.items() if k.startswith("global/")}
            for key, value in like.items():
                if key not in glob or tuple(glob[key].shape) != tuple(value.shape):
                    raise ValueError(f"global tensor {key} missing or reshaped")
            saved = SavedOuterState(
                global_state={k: glob[k].to(v.dtype) for k, v in like.items()},
                momentum={k[9:]: v for k, v in tensors.items() if k.startswith("momentum/")},
                outer_step=int(meta["outer_step"]),
                run_id=str(meta.get("run_id", "")),
                ledger={str(k): int(v) for k, v in json.loads(meta["ledger"]).items()},
                digests={str(k): str(v) for k, v in json.loads(meta["digests"]).items()},
            )
        except Exception as exc:
            self.path.replace(self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}"))
            raise ValueError(f"{type(exc).__name__}: {exc}") from None
        return saved

    def save(
        self,
        global_state: dict[str, torch.Tensor],
        momentum: dict[str, torch.Tensor],
        *,
        outer_step: int,
        run_id: str,
        ledger: dict[str, int],
        digests: dict[str, str],
    ) -> None:
        """Write the whole state as one atomic file."""
        tensors = {f"global/{k}": v for k, v in global_state.items()}
        tensors.update({f"momentum/{k}": v for k, v in momentum.items()})
        meta = {
            "format": _FORMAT,
            "outer_step": outer_step,
            "run_id": run_id,
            "ledger": json.dumps(dict(sorted(ledger.items()))),
            "digests": json.dumps(dict(sorted(digests.items()))),
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
