"""What goes into a checkpoint, as registered parts: :class:`CheckpointParts` maps each key to
the object that owns that state (``state_dict()`` / ``load_state_dict()``, loaded in place in
registration order); :class:`RNGState` makes the process RNGs (Python, NumPy, torch, CUDA)
such a part. Everything here survives ``torch.load(weights_only=True)``. The trainer's parts
are listed in :mod:`speedtronic.train.state`; files are written by
:class:`speedtronic.checkpoint.CheckpointManager`.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Mapping
from typing import Any, Protocol

import torch

__all__ = ["CheckpointParts", "RNGState", "Stateful", "capture_rng_state", "restore_rng_state"]


# ----------------------------------------------------------------------------- RNG state


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when available) CUDA RNG states as tensors/lists.

    The result survives ``torch.load(weights_only=True)``.
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np

        saved = np.random.get_state(legacy=True)
        assert isinstance(saved, tuple)  # legacy=True: always (kind, keys, pos, gauss, cached)
        kind, keys, pos, has_gauss, cached = saved
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    except Exception:  # NumPy missing or exotic
        state["numpy"] = None
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state: dict[str, Any] | None) -> None:
    """Restore what :func:`capture_rng_state` captured; each subsystem independently."""
    if not state:
        return
    python = state.get("python")
    if python:
        random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    if state.get("torch") is not None:
        torch.set_rng_state(state["torch"])
    numpy_state = state.get("numpy")
    if numpy_state:
        import numpy as np

        np.random.set_state(
            (
                numpy_state["kind"],
                numpy_state["keys"].numpy().astype("uint32"),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
    if state.get("cuda") and torch.cuda.is_available():
        with contextlib.suppress(Exception):
            torch.cuda.set_rng_state_all(state["cuda"])


class RNGState:
    """The process RNGs (Python, NumPy, torch CPU, CUDA) as a checkpoint part."""

    def state_dict(self) -> dict[str, Any]:
        """:func:`capture_rng_state` now."""
        return capture_rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:func:`restore_rng_state` now."""
        restore_rng_state(state)


# ----------------------------------------------------------------------------- parts


class Stateful(Protocol):
    """Anything a checkpoint holds: ``state_dict()`` out, ``load_state_dict(state)`` in place."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class CheckpointParts:
    """The named parts of one checkpoint, saved together and loaded in place, in order.

    ``parts`` maps a key of the checkpoint dictionary to the object that owns that state
    (``None`` for a part this run does not have: it is saved as ``None`` and skipped on load).
    The part named ``root`` writes its keys at the top level of the dictionary instead of under
    its name (the trainer's counters, so :func:`read_step` finds ``step``). Loading goes in
    registration order and skips parts whose saved value is missing or ``None``; register a
    part whose load must come last (the RNG) last.
    """

    def __init__(self, parts: Mapping[str, Stateful | None], *, root: str | None = None) -> None:
        if root is not None and root not in parts:
            raise ValueError(f"root part {root!r} is not registered")
        self.parts = dict(parts)
        self.root = root

    def state_dict(self) -> dict[str, Any]:
        """Every part's ``state_dict()`` under its name (the root part's keys at the top)."""
        state: dict[str, Any] = {}
        for name, part in self.parts.items():
            if part is None:
                state[name] = None
            elif name == self.root:
                state.update(part.state_dict())
            else:
                state[name] = part.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """``load_state_dict`` on every registered part that has saved state, in order."""
        for name, part in self.parts.items():
            value = state if name == self.root else state.get(name)
            if part is not None and value is not None:
                part.load_state_dict(value)
