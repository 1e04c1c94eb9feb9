"""The contribution and the safetensors files that carry it.

A contribution is ``float32(global_r) - float32(local)`` over the floating keys (the sign
points against local progress, so the master subtracts ``lr * mean``); several are averaged
in float32. A delta file carries string metadata (``node_id``, ``round``, ``run_id``,
``instance``, ``local_step``, ``base_outer_step``, ``dtype``, ``final``, and
:data:`DATA_DIGEST`: the sha256 of its values as written) and the values in
fp32, bf16 or fp16, or as int8/int4 codes with a float32 scale per block (``block_size`` in
the header; the encoding is :mod:`.codec`'s). This module writes and reads such files, and
globals, one tensor at a time, and checks everything read before it is used: the model's
keys and shapes, the digest, finite (as the model's dtypes will hold it), within
:data:`MAX_DELTA_ABS`.
Where the files lie and how big they may be is :mod:`.exchange`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import io
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from speedtronic.checkpoint import atomic_write_bytes
from speedtronic.diloco.codec import (
    DEFAULT_BLOCK_SIZE,
    DELTA_DTYPES,
    QUANTIZED_BITS,
    READ_SLICE,
    SCALE_SUFFIX,
    EncodedView,
    QuantizedTensor,
    WireCodec,
    delta_dtype,
    quantize,
    value_slices,
)

__all__ = [
    "DATA_DIGEST",
    "MAX_DELTA_ABS",
    "DeltaReader",
    "SafetensorsFile",
    "average_deltas",
    "check_layout",
    "compute_pseudo_gradient",
    "cpu_state_dict",
    "cpu_tensor",
    "delta_from_bytes",
    "delta_to_bytes",
    "first_non_finite",
    "floating_state",
    "is_all_zero",
    "load_delta",
    "load_safetensors",
    "open_delta",
    "open_safetensors",
    "read_metadata",
    "return_free_memory",
    "save_safetensors",
    "state_from_bytes",
    "state_to_bytes",
    "validate_delta",
    "write_delta",
    "write_quantized",
    "write_safetensors",
]


#: Header key of a delta file: the sha256 of its data section (every byte after the header),
#: written by the node with the file and checked on every read (:meth:`DeltaReader.check`,
#: :func:`delta_from_bytes`), as a global is checked against its record: a file changed or
#: damaged after it was written is refused. A file without it (written before this check)
#: is read unchecked.
DATA_DIGEST = "data_sha256"


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


def check_layout(baseline: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]) -> None:
    """A ``ValueError`` unless both states have the same keys with the same shapes."""
    missing_current = sorted(set(baseline) - set(current))
    missing_baseline = sorted(set(current) - set(baseline))
    if missing_current or missing_baseline:
        raise ValueError(
            "state keys differ: missing in current "
            f"{missing_current}, missing in baseline {missing_baseline}"
        )
    for key, base in baseline.items():
        cur = current[key]
        if tuple(base.shape) != tuple(cur.shape):
            raise ValueError(f"shape mismatch for {key}: {tuple(base.shape)} vs {tuple(cur.shape)}")


def compute_pseudo_gradient(
    baseline: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``float32(baseline) - float32(current)`` for every floating key (golden: [3,5]-[1,4]=[2,1]).

    Key sets must match and every shape must agree, else ``ValueError``.
    """
    check_layout(baseline, current)
    delta: dict[str, torch.Tensor] = {}
    for key, base in baseline.items():
        cur = current[key]
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


#: safetensors' names of the dtypes a state may hold.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}


def write_safetensors(
    handle: BinaryIO,
    state: Mapping[str, torch.Tensor],
    *,
    metadata: Mapping[str, object] | None = None,
    dtype: torch.dtype | None = None,
    digest_key: str | None = None,
) -> str:
    """Write ``state`` in the safetensors format to the binary file ``handle``, one tensor at
    a time (at most one tensor's converted copy in memory, never the whole file); floating
    tensors are cast to ``dtype`` if given. Returns the sha256 of the bytes written; with
    ``digest_key`` (a seekable ``handle``), the header names the sha256 of the data section
    under that key and that digest is returned (:data:`DATA_DIGEST` for a delta)."""
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for key, value in state.items():
        out = dtype if dtype is not None and value.is_floating_point() else value.dtype
        layout.append((str(key), out, tuple(value.shape)))
    return _write_entries(
        handle, layout, lambda key, out: state[key], metadata, digest_key=digest_key
    )


def _write_entries(
    handle: BinaryIO,
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
    produce: Callable[[str, torch.dtype], torch.Tensor],
    metadata: Mapping[str, object] | None,
    *,
    digest_key: str | None = None,
) -> str:
    """The safetensors writer: the header from ``layout`` (key, dtype, shape), then each
    entry's bytes as ``produce(key, dtype)`` makes them, one at a time, in layout order.

    With ``digest_key`` (and a seekable ``handle``), the header's metadata carries under that
    key the sha256 of the data section (every byte after the header), written as a
    placeholder of the same width and filled in once the data is written: one pass."""
    seekable = digest_key is not None and handle.seekable()
    placeholder = f'"{digest_key}":"{"0" * 64}"'.encode()
    if seekable:
        metadata = {**dict(metadata or {}), str(digest_key): "0" * 64}
    header: dict[str, Any] = {}
    offset = 0
    for key, out, shape in layout:
        size = math.prod(shape) * torch.empty((), dtype=out).element_size()
        header[key] = {
            "dtype": _SAFETENSORS_DTYPES[out],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    start = handle.tell() if seekable else 0
    digest = hashlib.sha256()  # of the whole file; with digest_key, of the data section
    for chunk in (len(raw).to_bytes(8, "little"), raw):
        handle.write(chunk)
        if not seekable:
            digest.update(chunk)
    for key, out, shape in layout:
        tensor = produce(key, out).detach().to("cpu", out).contiguous().reshape(-1)
        if tensor.numel() != math.prod(shape):
            raise ValueError(f"{key}: {tensor.numel()} values, the header says {shape}")
        if tensor.numel():
            view = memoryview(tensor.view(torch.uint8).numpy())
            handle.write(view)
            digest.update(view)
    if seekable:  # the placeholder (one key, so unique in the header) becomes the digest
        end = handle.tell()
        handle.seek(start + 8)
        named = f'"{digest_key}":"{digest.hexdigest()}"'.encode()
        handle.write(raw.replace(placeholder, named, 1))
        handle.seek(end)
    return digest.hexdigest()


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


def delta_to_bytes(delta: Mapping[str, torch.Tensor | QuantizedTensor], **header: Any) -> bytes:
    """Delta file bytes (see :func:`write_delta`, which takes the same arguments)."""
    buffer = io.BytesIO()
    write_delta(buffer, delta, **header)
    return buffer.getvalue()


def write_delta(
    handle: BinaryIO,
    delta: Mapping[str, torch.Tensor | QuantizedTensor],
    *,
    node_id: str,
    local_step: int,
    base_outer_step: int,
    round_index: int | None = None,
    dtype: str = "fp32",
    extra: Mapping[str, object] | None = None,
    block_size: int | None = None,
) -> None:
    """Write a delta file to ``handle`` one tensor at a time: the core header keys and the
    values in wire format ``dtype``.

    ``round_index`` is the round the contribution is meant for (defaults to
    ``base_outer_step``); ``local_step`` the node's optimizer step when it was taken. With
    ``int8``/``int4`` the values are quantized in blocks of ``block_size`` values (default
    :data:`DEFAULT_BLOCK_SIZE`; a value already given as a :class:`QuantizedTensor`, see
    :func:`.codec.encode_delta`, is written as it is).
    """
    name = (dtype or "fp32").lower()
    delta_dtype(name)  # a ValueError for an unknown format
    metadata: dict[str, object] = {
        "node_id": node_id,
        "round": int(base_outer_step if round_index is None else round_index),
        "local_step": int(local_step),
        "base_outer_step": int(base_outer_step),
        "algorithm": "dumb_diloco",
        "dtype": name,
        **dict(extra or {}),
    }
    if isinstance(delta, EncodedView):  # the same codes, made again as they are written
        if delta.dtype != name:
            raise ValueError(f"the values are encoded as {delta.dtype}, the file says {name}")
        block_size, delta = delta.block_size, delta.source
    if name not in QUANTIZED_BITS:
        write_safetensors(
            handle, delta, metadata=metadata, dtype=DELTA_DTYPES[name], digest_key=DATA_DIGEST
        )
        return
    block = int(block_size or DEFAULT_BLOCK_SIZE)
    write_quantized(handle, delta, name, block, metadata, digest_key=DATA_DIGEST)


def write_quantized(
    handle: BinaryIO,
    values: Mapping[str, torch.Tensor | QuantizedTensor],
    dtype: str,
    block_size: int,
    metadata: Mapping[str, object],
    *,
    digest_key: str | None = None,
) -> str:
    """Write ``values`` blockwise-quantized (``int8``/``int4``; float tensors are quantized
    as they are written, one at a time) with ``metadata`` and what a reader needs to decode
    them (the block size; every shape for int4, whose packed codes lose it): each tensor's
    codes under its key, its scales beside it. Returns the file's sha256 (with
    ``digest_key``: the data section's, named in the header as :func:`write_safetensors`
    does)."""
    bits = QUANTIZED_BITS[dtype]
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    shapes: dict[str, list[int]] = {}
    for key, value in values.items():
        quantized = isinstance(value, QuantizedTensor)
        if quantized and (value.bits, value.block_size) != (bits, block_size):
            raise ValueError(f"{key} is quantized otherwise than {dtype}/{block_size}")
        shape = tuple(value.shape)
        numel = math.prod(shape)
        codes = shape if bits == 8 else (-(-numel // 2),)
        layout.append((str(key), delta_dtype(dtype), codes))
        layout.append((str(key) + SCALE_SUFFIX, torch.float32, (-(-numel // block_size),)))
        shapes[str(key)] = list(shape)
    header = {**metadata, "block_size": str(block_size)}
    if dtype == "int4":
        header["shapes"] = json.dumps(shapes, sort_keys=True, separators=(",", ":"))
    last: list[QuantizedTensor] = []  # the tensor being written: its codes, then its scales

    def produce(key: str, out: torch.dtype) -> torch.Tensor:
        if key.endswith(SCALE_SUFFIX):
            return last.pop().scales
        value = values[key]
        if not isinstance(value, QuantizedTensor):
            value = quantize(value, bits, block_size)
        last.append(value)
        return value.codes

    return _write_entries(handle, layout, produce, header, digest_key=digest_key)


def delta_from_bytes(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse a delta file; tensors come back as float32 (the master aggregates in fp32).

    Only the wire dtypes (fp32, bf16, fp16) are accepted as values: an integer or boolean
    tensor is a ``ValueError``, never silently converted. A quantized file (``int8``,
    ``int4`` in its header) is decoded, its codes and scales checked as in
    :meth:`DeltaReader.check` (without a model to compare keys and shapes with).
    """
    tensors, metadata = state_from_bytes(data)
    codec = WireCodec.from_metadata(metadata)
    if codec.bits is not None:
        shapes = codec.shapes_from(metadata, tensors)
        values = {
            key: codec.read(key, tensors.__getitem__, shape, MAX_DELTA_ABS)
            for key, shape in shapes.items()
        }
    else:
        wire = set(DELTA_DTYPES.values())
        for key, value in tensors.items():
            if value.dtype not in wire:
                raise ValueError(f"{key} is {value.dtype}; a delta holds fp32, bf16 or fp16 values")
        values = {k: v.to(torch.float32) for k, v in tensors.items()}
    named = metadata.get(DATA_DIGEST)  # last, as DeltaReader.check does
    if named is not None:
        start = 8 + int.from_bytes(data[:8], "little")
        _check_digest(named, hashlib.sha256(memoryview(data)[start:]).hexdigest())
    return values, metadata


def _check_digest(named: str, actual: str) -> None:
    """A ``ValueError`` unless the data's sha256 is the one the header names."""
    if actual != named:
        raise ValueError(
            f"its values do not match the digest in its header ({DATA_DIGEST} "
            f"{named[:12]}..., the data hashes to {actual[:12]}...): changed or damaged after "
            "it was written"
        )


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
        cast = target.dtype if target is not None and _is_floating(target) else value.dtype
        flat = value.reshape(-1)
        for start, stop in value_slices(flat.numel()):  # temporaries of one slice
            if not bool(torch.isfinite(flat[start:stop].to(cast)).all()):
                return key
    return None


def return_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``). A round's
    slice-sized temporaries come from the heap, and without this the process keeps their
    pages resident: memory the model does not need stays counted as the process's."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only: another C library has none
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _load_libc()


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
    """A delta file opened once: :meth:`check` validates it tensor by tensor, :meth:`add_to`
    folds it into a running sum; a float delta is read a slice at a time (a quantized one a
    tensor at a time)."""

    def __init__(self, handle: SafetensorsFile):
        self._handle = handle
        self.metadata = {str(k): str(v) for k, v in (handle.metadata() or {}).items()}
        self._codec: WireCodec | None = None  # the file's encoding, read by check()

    def check(
        self, reference: Mapping[str, torch.Tensor], *, max_abs: float = MAX_DELTA_ABS
    ) -> str:
        """The same checks as :func:`validate_delta` plus the wire dtypes and the digest the
        header names (:data:`DATA_DIGEST`) (``ValueError``); returns the sha256 of the values
        (a re-sent copy has the same digest).

        A quantized file (``int8``/``int4`` in its header, with its ``block_size``) must hold
        for every model key its codes (the model's shape for int8, two codes a byte for
        int4) and one float32 scale per block; scales finite, non-negative and at most
        ``max_abs`` over the largest code (so no decoded value exceeds ``max_abs``), codes
        within their symmetric range."""
        codec = WireCodec.from_metadata(self.metadata)
        if codec.bits is not None:
            values = self._check_quantized(codec, reference, max_abs)
        else:
            values = self._check_float(reference, max_abs)
        named = self.metadata.get(DATA_DIGEST)  # last: a bad value is named for what it is
        if named is not None:
            _check_digest(named, self._handle.data_sha256())
        return values

    def _check_float(self, reference: Mapping[str, torch.Tensor], max_abs: float) -> str:
        expected = _expected_keys(self._handle.keys(), reference)
        wire = set(DELTA_DTYPES.values())
        digest = hashlib.sha256()
        for key in sorted(expected):
            dtype, shape = self._handle.dtype(key), self._handle.shape(key)
            if dtype not in wire:
                raise ValueError(f"{key} is {dtype}; a delta holds fp32, bf16 or fp16 values")
            if shape != tuple(expected[key].shape):
                raise ValueError(
                    f"shape mismatch for {key}: {shape} vs {tuple(expected[key].shape)}"
                )
            digest.update(key.encode("utf-8"))
            peak = 0.0
            for part in self._slices(key, expected[key].numel()):  # one slice in memory
                if not bool(torch.isfinite(part).all()):
                    raise ValueError(f"non-finite values in {key}")
                peak = max(peak, float(part.abs().max()) if part.numel() else 0.0)
                digest.update(part.view(torch.uint8).numpy())
            if peak > max_abs:
                raise ValueError(f"{key} holds {peak:.3g}, beyond the bound {max_abs:g}")
        return digest.hexdigest()

    def _slices(self, key: str, count: int) -> Iterator[torch.Tensor]:
        """Tensor ``key`` (``count`` values), read :data:`READ_SLICE` values at a time."""
        for start in range(0, count, READ_SLICE):
            yield self._handle.read_flat(key, start, start + READ_SLICE)

    def _check_quantized(
        self, codec: WireCodec, reference: Mapping[str, torch.Tensor], max_abs: float
    ) -> str:
        expected = {k: v for k, v in reference.items() if _is_floating(v)}
        keys = set(self._handle.keys())
        wanted = set(expected) | {k + SCALE_SUFFIX for k in expected}
        if keys != wanted:
            extra = sorted(keys - wanted)[:5]
            missing = sorted(wanted - keys)[:5]
            raise ValueError(
                f"delta keys do not match the model (extra {extra}, missing {missing})"
            )
        digest = hashlib.sha256()
        for key in sorted(expected):
            codec.read(key, self._handle.get_tensor, tuple(expected[key].shape), max_abs)
            for name in (key, key + SCALE_SUFFIX):
                digest.update(name.encode("utf-8"))
                value = self._handle.get_tensor(name).contiguous()
                digest.update(value.view(torch.uint8).numpy().tobytes())
        self._codec = codec
        return digest.hexdigest()

    def add_to(self, total: dict[str, torch.Tensor], scale: float = 1.0) -> None:
        """``total[key] += scale * value`` in float32 for every key (checked first); a
        quantized file is decoded one tensor at a time."""
        codec = self._codec or WireCodec.from_metadata(self.metadata)
        for key in sorted(total):
            if codec.bits is None:  # a slice at a time (slices of whole vector widths)
                flat, start = total[key].view(-1), 0
                for part in self._slices(key, flat.numel()):
                    flat[start : start + part.numel()].add_(part.to(torch.float32), alpha=scale)
                    start += part.numel()
                continue
            shape = tuple(total[key].shape)
            value = codec.read(key, self._handle.get_tensor, shape, MAX_DELTA_ABS)
            total[key].add_(value, alpha=scale)


class SafetensorsFile:
    """A safetensors file read one tensor at a time with plain reads: no memory map, so only
    the tensor being read takes memory (a mapped file's pages would count as the process's
    own while it is open). The header is checked when the file is opened (known dtypes, and
    each tensor's byte range inside the file and as long as its shape and dtype say);
    damage is a ``ValueError``. Offers ``metadata()``, ``keys()``, ``shape(key)`` and
    ``get_tensor(key)``, as the handle of safetensors' ``safe_open`` does."""

    def __init__(self, handle: BinaryIO):
        size = os.fstat(handle.fileno()).st_size
        length = int.from_bytes(handle.read(8), "little")
        if size < 8 or length <= 0 or 8 + length > size:
            raise ValueError("not a safetensors file (bad header length)")
        header = _header(length.to_bytes(8, "little") + handle.read(length))
        self._metadata = {
            str(k): str(v) for k, v in (header.pop("__metadata__", None) or {}).items()
        }
        self._handle, self._start = handle, 8 + length
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            try:
                dtype = _TORCH_DTYPES[info["dtype"]]
                shape = tuple(int(n) for n in info["shape"])
                begin, end = (int(n) for n in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"not a safetensors file (bad entry for {key!r})") from None
            count = 1
            for n in shape:
                count *= n
            width = torch.empty((), dtype=dtype).element_size()
            if min(shape, default=0) < 0 or not 0 <= begin <= end <= size - self._start:
                raise ValueError(f"not a safetensors file ({key!r} lies outside the file)")
            if end - begin != count * width:
                raise ValueError(f"not a safetensors file ({key!r} has the wrong length)")
            self._entries[str(key)] = (dtype, shape, begin, end)

    def metadata(self) -> dict[str, str]:
        """The header's string metadata (``{}`` when absent)."""
        return dict(self._metadata)

    def keys(self) -> list[str]:
        """The tensor names, in the header's order."""
        return list(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of tensor ``key`` (read from the header only)."""
        return self._entries[key][1]

    def dtype(self, key: str) -> torch.dtype:
        """The dtype of tensor ``key`` (read from the header only)."""
        return self._entries[key][0]

    def data_sha256(self) -> str:
        """The sha256 of the data section (every byte after the header), read in chunks."""
        digest = hashlib.sha256()
        self._handle.seek(self._start)
        while chunk := self._handle.read(1 << 20):
            digest.update(chunk)
        return digest.hexdigest()

    def get_tensor(self, key: str) -> torch.Tensor:
        """Tensor ``key``, read from the file into a new CPU tensor."""
        dtype, shape, begin, end = self._entries[key]
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        return self.read_flat(key, 0, count).reshape(shape)

    def read_flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Values ``start`` to ``stop`` (clipped to its size) of tensor ``key`` flattened, read
        from the file into a new 1-D CPU tensor: a slice of a large tensor costs its own size."""
        dtype, _, begin, end = self._entries[key]
        width = torch.empty((), dtype=dtype).element_size()
        first = min(begin + start * width, end)
        last = min(begin + stop * width, end)
        raw = torch.empty(last - first, dtype=torch.uint8)
        self._handle.seek(self._start + first)
        if last > first and self._handle.readinto(memoryview(raw.numpy())) != last - first:
            raise ValueError(f"{key} is truncated")
        return raw.view(dtype)


@contextlib.contextmanager
def open_safetensors(path: str | os.PathLike) -> Iterator[SafetensorsFile]:
    """A local safetensors file opened for :class:`SafetensorsFile`; damage is a
    ``ValueError``."""
    with open(path, "rb") as handle:
        yield SafetensorsFile(handle)


@contextlib.contextmanager
def open_delta(path: str | os.PathLike) -> Iterator[DeltaReader]:
    """Open a local delta file for :class:`DeltaReader`; an unreadable file is a ValueError."""
    try:
        opened = open_safetensors(path)
        reader = DeltaReader(opened.__enter__())
    except ValueError as exc:
        raise ValueError(f"not a safetensors delta: {exc}") from None
    try:
        yield reader
    finally:
        opened.__exit__(None, None, None)
