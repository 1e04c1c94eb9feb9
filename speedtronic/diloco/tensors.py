"""Tensor format of DumbDiLoCo: safetensors files, pseudo-gradients, delta paths.

Everything here is a pure function over ``name -> tensor`` dicts. Deltas are
``float32(baseline) - float32(current)`` over floating/complex keys (the sign points
*against* local progress, so the master subtracts ``lr * update``). Deltas travel as
safetensors with string metadata (``node_id``, ``round``, ``local_step``,
``base_outer_step``, ``algorithm``, ``dtype``, ``final``); the wire dtype may be fp32, bf16
or fp16, and the master always aggregates in float32.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from speedtronic.checkpoint import atomic_write_bytes
from speedtronic.config.limits import is_valid_node_id

__all__ = [
    "DELTA_DTYPES",
    "MAX_DELTA_ABS",
    "DeltaReader",
    "average_deltas",
    "compute_pseudo_gradient",
    "cpu_state_dict",
    "cpu_tensor",
    "delta_dtype",
    "delta_from_bytes",
    "delta_path",
    "delta_to_bytes",
    "first_non_finite",
    "floating_state",
    "is_all_zero",
    "load_delta",
    "load_safetensors",
    "open_delta",
    "parse_delta_path",
    "read_metadata",
    "save_safetensors",
    "state_from_bytes",
    "state_to_bytes",
    "validate_delta",
]

#: Wire dtypes accepted by ``distributed.delta_dtype``.
DELTA_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}

_DELTA_NAME = re.compile(r"^delta_(0|[1-9][0-9]*)\.safetensors$")


def cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Detached, contiguous CPU clone (clones break storage sharing such as tied weights)."""
    return tensor.detach().to("cpu").contiguous().clone()


def cpu_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU clone of every tensor, keys converted to ``str``."""
    return {str(key): cpu_tensor(value) for key, value in state.items()}


def _is_floating(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def floating_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The floating-point or complex entries of ``state``."""
    return {key: value for key, value in state.items() if _is_floating(value)}


def delta_dtype(name: str | None) -> torch.dtype:
    """Map ``fp32|bf16|fp16`` (None -> fp32) to a torch dtype; anything else is a ValueError."""
    key = (name or "fp32").lower()
    if key not in DELTA_DTYPES:
        raise ValueError(
            f"distributed.delta_dtype must be one of {sorted(DELTA_DTYPES)}, got {name!r}"
        )
    return DELTA_DTYPES[key]


def compute_pseudo_gradient(
    baseline: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``float32(baseline) - float32(current)`` for every floating key (golden: [3,5]-[1,4]=[2,1]).

    Key sets must match and every shape must agree, else ``ValueError``.
    """
    missing_current = sorted(set(baseline) - set(current))
    missing_baseline = sorted(set(current) - set(baseline))
    if missing_current or missing_baseline:
        raise ValueError(
            "state keys differ: missing in current "
            f"{missing_current}, missing in baseline {missing_baseline}"
        )
    delta: dict[str, torch.Tensor] = {}
    for key, base in baseline.items():
        cur = current[key]
        if tuple(base.shape) != tuple(cur.shape):
            raise ValueError(f"shape mismatch for {key}: {tuple(base.shape)} vs {tuple(cur.shape)}")
        if _is_floating(base):
            b = base.detach().to("cpu")
            c = cur.detach().to("cpu")
            if b.is_complex():
                b, c = b.real, c.real
            delta[key] = b.to(torch.float32) - c.to(torch.float32)
    return delta


def average_deltas(deltas: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Equal-weight float32 mean of deltas with identical keys and shapes."""
    items = list(deltas)
    if not items:
        raise ValueError("average_deltas needs at least one delta")
    keys = set(items[0])
    total: dict[str, torch.Tensor] = {
        key: value.detach().to("cpu", torch.float32, copy=True) for key, value in items[0].items()
    }
    for delta in items[1:]:
        if set(delta) != keys:
            raise ValueError("all deltas must have the same keys")
        for key, value in delta.items():
            if tuple(value.shape) != tuple(total[key].shape):
                raise ValueError(f"shape mismatch for {key}")
            total[key].add_(value.detach().to("cpu", torch.float32))
    count = float(len(items))
    return {key: value.div_(count) for key, value in total.items()}


def is_all_zero(delta: Mapping[str, torch.Tensor]) -> bool:
    """True when every tensor of ``delta`` is exactly zero (nothing to upload)."""
    return all(not bool(torch.count_nonzero(value)) for value in delta.values())


def is_path_safe(identifier: str) -> bool:
    """A node id by the one node-id rule of the config layer (letters, digits, ``._@+-``,
    starting with a letter or digit, at most 128 characters): a single path segment."""
    return is_valid_node_id(identifier)


def delta_path(node_id: str, round_index: int) -> str:
    """Remote path ``nodes/<node_id>/delta_<round>.safetensors`` of a node's contribution to
    round ``round_index`` (the outer step it is meant to update; 2.0.0 used the local step)."""
    return f"nodes/{node_id}/delta_{int(round_index)}.safetensors"


def parse_delta_path(path: str) -> tuple[str, int] | None:
    """``nodes/<node>/delta_<n>.safetensors`` -> ``(node, n)``; anything else -> None.

    Strict: the node must be path-safe and ``n`` a canonical non-negative integer.
    """
    parts = str(path).split("/")
    if len(parts) != 3 or parts[0] != "nodes" or not is_path_safe(parts[1]):
        return None
    match = _DELTA_NAME.match(parts[2])
    if match is None:
        return None
    return parts[1], int(match.group(1))


def state_to_bytes(
    state: Mapping[str, torch.Tensor],
    *,
    metadata: Mapping[str, object] | None = None,
    dtype: torch.dtype | None = None,
) -> bytes:
    """Serialise ``state`` as safetensors bytes; floating tensors are cast to ``dtype`` if given."""
    from safetensors.torch import save

    tensors = {}
    for key, value in state.items():
        tensor = cpu_tensor(value)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[str(key)] = tensor
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    return save(tensors, metadata=meta)


def _header(data: bytes) -> dict:
    if len(data) < 8:
        raise ValueError("not a safetensors file (too short)")
    size = int.from_bytes(data[:8], "little")
    if size <= 0 or 8 + size > len(data):
        raise ValueError("not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a safetensors file (bad header: {exc})") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (header is not an object)")
    return header


def state_from_bytes(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse safetensors bytes into ``(tensors, metadata)``; any damage is a ``ValueError``."""
    from safetensors.torch import load

    header = _header(data)
    metadata = header.get("__metadata__") or {}
    try:
        tensors = load(bytes(data))
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise ValueError(f"unable to load safetensors data: {exc}") from None
    return dict(tensors), {str(k): str(v) for k, v in metadata.items()}


def delta_to_bytes(
    delta: Mapping[str, torch.Tensor],
    *,
    node_id: str,
    local_step: int,
    base_outer_step: int,
    round_index: int | None = None,
    dtype: str = "fp32",
    extra: Mapping[str, object] | None = None,
) -> bytes:
    """Delta file bytes with the core header keys and the wire dtype.

    ``round_index`` is the round the contribution is meant for (defaults to
    ``base_outer_step``); ``local_step`` the node's optimizer step when it was taken.
    """
    metadata = {
        "node_id": node_id,
        "round": int(base_outer_step if round_index is None else round_index),
        "local_step": int(local_step),
        "base_outer_step": int(base_outer_step),
        "algorithm": "dumb_diloco",
        "dtype": (dtype or "fp32").lower(),
        **dict(extra or {}),
    }
    return state_to_bytes(delta, metadata=metadata, dtype=delta_dtype(dtype))


def delta_from_bytes(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse a delta file; tensors come back as float32 (the master aggregates in fp32).

    Only the wire dtypes (fp32, bf16, fp16) are accepted: an integer or boolean tensor is a
    ``ValueError``, never silently converted.
    """
    tensors, metadata = state_from_bytes(data)
    wire = set(DELTA_DTYPES.values())
    for key, value in tensors.items():
        if value.dtype not in wire:
            raise ValueError(f"{key} is {value.dtype}; a delta holds fp32, bf16 or fp16 values")
    return {k: v.to(torch.float32) for k, v in tensors.items()}, metadata


#: Largest magnitude accepted in a pseudo-gradient: a weight that moves this much in one round
#: has diverged (and sums of a few such values stay far from float32 overflow).
MAX_DELTA_ABS = 1.0e4


def first_non_finite(
    state: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor] | None = None
) -> str | None:
    """The first floating key of ``state`` holding NaN or inf, else None.

    With ``like`` (the model's state), each tensor is checked as it will be installed: cast
    to ``like``'s dtype for that key (a float64 1e300 is finite in the file and inf in a
    float32 model)."""
    for key, value in state.items():
        if not _is_floating(value):
            continue
        target = like.get(key) if like is not None else None
        if target is not None and _is_floating(target) and target.dtype != value.dtype:
            value = value.to(target.dtype)
        if not bool(torch.isfinite(value).all()):
            return key
    return None


def validate_delta(
    delta: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    *,
    max_abs: float = MAX_DELTA_ABS,
) -> None:
    """Reject a delta whose keys/shapes differ from the floating part of ``reference``, that
    holds NaN/inf, or a value beyond ``max_abs`` (``ValueError`` naming the problem)."""
    expected = _expected_keys(delta.keys(), reference)
    for key, value in delta.items():
        _check_tensor(key, value, expected[key], max_abs)


def _expected_keys(
    keys: Iterable[str], reference: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The floating entries of ``reference``; ``keys`` must be exactly their names."""
    expected = {k: v for k, v in reference.items() if _is_floating(v)}
    have = set(keys)
    if have != set(expected):
        extra = sorted(have - set(expected))[:5]
        missing = sorted(set(expected) - have)[:5]
        raise ValueError(f"delta keys do not match the model (extra {extra}, missing {missing})")
    return expected


def _check_tensor(key: str, value: torch.Tensor, expected: torch.Tensor, max_abs: float) -> None:
    """One delta tensor: the model's shape, finite, within ``max_abs`` (``ValueError``)."""
    if tuple(value.shape) != tuple(expected.shape):
        raise ValueError(
            f"shape mismatch for {key}: {tuple(value.shape)} vs {tuple(expected.shape)}"
        )
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"non-finite values in {key}")
    peak = float(value.abs().max()) if value.numel() else 0.0
    if peak > max_abs:
        raise ValueError(f"{key} holds {peak:.3g}, beyond the bound {max_abs:g}")


def save_safetensors(
    state: Mapping[str, torch.Tensor], path: str | os.PathLike, *, metadata=None
) -> Path:
    """Atomically write ``state`` to ``path`` (temp file + rename)."""
    return atomic_write_bytes(state_to_bytes(state, metadata=metadata), path)


def load_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file onto the CPU."""
    return state_from_bytes(Path(path).read_bytes())[0]


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """Header metadata of a safetensors file (``{}`` when absent)."""
    data = Path(path).read_bytes()
    return {str(k): str(v) for k, v in (_header(data).get("__metadata__") or {}).items()}


def load_delta(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of a delta file; damage is a ``ValueError``."""
    return state_from_bytes(Path(path).read_bytes())


class DeltaReader:
    """A delta file opened once (memory-mapped): :meth:`check` validates it tensor by tensor,
    :meth:`add_to` folds it into a running sum; at most one tensor is in memory at a time."""

    def __init__(self, handle: Any):
        self._handle = handle
        self.metadata = {str(k): str(v) for k, v in (handle.metadata() or {}).items()}

    def check(
        self, reference: Mapping[str, torch.Tensor], *, max_abs: float = MAX_DELTA_ABS
    ) -> str:
        """The same checks as :func:`validate_delta` plus the wire dtypes (``ValueError``);
        returns the sha256 of the values (a re-sent copy has the same digest)."""
        expected = _expected_keys(self._handle.keys(), reference)
        wire = set(DELTA_DTYPES.values())
        digest = hashlib.sha256()
        for key in sorted(expected):
            value = self._handle.get_tensor(key)
            if value.dtype not in wire:
                raise ValueError(f"{key} is {value.dtype}; a delta holds fp32, bf16 or fp16 values")
            _check_tensor(key, value, expected[key], max_abs)
            digest.update(key.encode("utf-8"))
            digest.update(value.contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def add_to(self, total: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        """``total[key] += scale * value`` in float32 for every key (checked first)."""
        for key in sorted(total):
            total[key].add_(self._handle.get_tensor(key).to(torch.float32), alpha=scale)


@contextlib.contextmanager
def open_delta(path: str | os.PathLike) -> Iterator[DeltaReader]:
    """Open a local delta file for :class:`DeltaReader`; an unreadable file is a ValueError."""
    from safetensors import safe_open

    try:
        handle = safe_open(os.fspath(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise ValueError(f"not a safetensors delta: {exc}") from None
    with handle as opened:
        yield DeltaReader(opened)
