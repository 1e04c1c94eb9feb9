"""The wire format: how a contribution's values are encoded, and the safetensors files that
carry contributions and globals.

A contribution is ``float32(global_r) - float32(local)`` over the floating keys (the sign
points against local progress, so the master subtracts ``lr * mean``); several are averaged
in float32. Its values travel as fp32, bf16 or fp16 (casts) or as int8/int4 codes (blockwise
symmetric, one float32 scale per block, under ``<key>::scale``), with string metadata
(``node_id``, ``round``, ``run_id``, ``instance``, ``local_step``, ``base_outer_step``,
``dtype``, ``block_size``, ``final``, :data:`DATA_DIGEST`). Files are written and read one
tensor at a time (a large one ~1 MiB at a time), and what is read is checked before it is
used: keys and shapes (:func:`check_like`, the one such check), wire dtypes, codes and scales,
digest, finite, within :data:`MAX_DELTA_ABS`. Where files lie is :mod:`.exchange`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, Concatenate, ParamSpec, TypeAlias, TypeVar

import torch

from speedtronic.atomic_files import atomic_write_with

_PathArg: TypeAlias = "str | os.PathLike[str]"

#: Float wire dtypes accepted by ``distributed.delta_dtype``.
DELTA_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
#: Blockwise-quantized wire formats of ``distributed.delta_dtype``: bits per code.
QUANTIZED_BITS: dict[str, int] = {"int8": 8, "int4": 4}
#: Every value of ``distributed.delta_dtype``.
DELTA_FORMATS: tuple[str, ...] = (*DELTA_DTYPES, *QUANTIZED_BITS)
#: Values per float32 scale when ``distributed.delta_block_size`` does not say (docs/diloco.md,
#: "Compressed deltas": int8 under 0.26x, int4 under 0.14x of fp32, as good as smaller blocks).
DEFAULT_BLOCK_SIZE = 128
#: Block sizes a file may declare (the config's bounds).
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 1 << 20
#: Key suffix of a tensor's block scales in a quantized file.
SCALE_SUFFIX = "::scale"
#: Header key of a delta file: the sha256 of its data section (every byte after the header),
#: checked on every read (a file changed after it was written is refused; none: unchecked).
DATA_DIGEST = "data_sha256"
#: Largest magnitude accepted in a pseudo-gradient: a weight that moves this much in one round
#: has diverged (and sums of a few such values stay far from float32 overflow).
MAX_DELTA_ABS = 1.0e4
#: Values worked on at a time (fp32: 1 MiB), so temporaries stay small whatever the model.
SLICE = 1 << 18


def delta_dtype(name: str | None) -> torch.dtype:
    """Map ``fp32|bf16|fp16`` (None -> fp32) to the torch dtype of its values, and ``int8`` /
    ``int4`` to the dtype of their codes (``int8``; ``uint8`` holding two 4-bit codes per
    byte); anything else is a ValueError."""
    dtypes = {**DELTA_DTYPES, "int8": torch.int8, "int4": torch.uint8}
    key = (name or "fp32").lower()
    if key not in dtypes:
        raise ValueError(
            f"distributed.delta_dtype must be one of {list(DELTA_FORMATS)}, got {name!r}"
        )
    return dtypes[key]


def value_slices(numel: int, block_size: int = 1) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive slices of about :data:`SLICE` values covering
    ``numel``, each of whole blocks of ``block_size`` values and of an even count (4-bit codes
    pack within a slice). Blocks are local, so codes made a slice at a time are the whole
    tensor's."""
    step = block_size * max(1, SLICE // block_size)
    step *= 1 + step % 2
    for start in range(0, numel, step):
        yield start, min(start + step, numel)


def _code_shape(bits: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a value's codes: the value's (8 bits), or its count over two (4 bits)."""
    return shape if bits == 8 else (-(-math.prod(shape) // 2),)


# -- quantized values ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """One tensor in blocks of ``block_size`` consecutive values (row-major order, the last
    block shorter), each block ``codes * scale`` with integer codes in ``[-q, q]`` (q = 127
    for 8 bits, 7 for 4 bits) and one float32 ``scale`` = the block's largest magnitude / q.

    ``codes``: int8 with the tensor's shape (8 bits), or uint8 of ``ceil(n / 2)`` bytes each
    holding two codes + 8 (4 bits; low nibble first; an odd tail is padded with code 0).
    ``scales``: float32 of ``ceil(n / block_size)``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]
    bits: int
    block_size: int

    def dequantize(self) -> torch.Tensor:
        """The float32 values the master adds: ``code * scale`` of each value's block
        (decoded a slice of blocks at a time)."""
        numel = math.prod(self.shape)
        flat = self.codes.reshape(-1)
        out = torch.empty(numel, dtype=torch.float32)
        for start, stop in value_slices(numel, self.block_size):
            if self.bits == 8:
                codes = flat[start:stop].to(torch.float32)
            else:
                packed = flat[start // 2 : (stop + 1) // 2]
                pairs = torch.stack((packed & 0xF, packed >> 4), dim=1).reshape(-1)
                codes = pairs[: stop - start].to(torch.float32).sub_(8.0)
            first, blocks = start // self.block_size, -(-(stop - start) // self.block_size)
            padded = torch.zeros(blocks * self.block_size, dtype=torch.float32)
            padded[: stop - start] = codes
            values = padded.view(blocks, self.block_size)
            values.mul_(self.scales[first : first + blocks].view(blocks, 1))
            out[start:stop] = values.reshape(-1)[: stop - start]
        return out.reshape(self.shape)


#: A value as the wire carries it: a float tensor (fp32, bf16, fp16) or codes and scales.
Encoded: TypeAlias = "torch.Tensor | QuantizedTensor"


def quantize(tensor: torch.Tensor, bits: int, block_size: int) -> QuantizedTensor:
    """Blockwise symmetric absmax quantization of ``tensor`` (float32 arithmetic, round half
    to even: deterministic, so a node and the ideal arithmetic send the same codes), a slice
    of blocks at a time."""
    flat = tensor.detach().to("cpu", torch.float32).reshape(-1)
    numel = flat.numel()
    top = (1 << (bits - 1)) - 1  # the largest code magnitude: 127, 7
    scales = torch.empty(-(-numel // block_size), dtype=torch.float32)
    codes_of = torch.empty(_code_shape(bits, tuple(tensor.shape)), dtype=delta_dtype(f"int{bits}"))
    packed = codes_of.view(-1)
    for start, stop in value_slices(numel, block_size):
        blocks = -(-(stop - start) // block_size)
        padded = torch.zeros(blocks * block_size, dtype=torch.float32)
        padded[: stop - start] = flat[start:stop]
        view = padded.view(blocks, block_size)
        part = view.abs().amax(dim=1).div_(float(top))
        scales[start // block_size : start // block_size + blocks] = part
        safe = torch.where(part > 0, part, torch.ones_like(part))
        codes = torch.round(view / safe.view(blocks, 1)).clamp_(-top, top).reshape(-1)
        codes = codes[: stop - start]
        if bits == 8:
            packed[start:stop] = codes.to(torch.int8)
            continue
        nibbles = codes.to(torch.int16).add_(8).to(torch.uint8)
        if nibbles.numel() % 2:
            nibbles = torch.cat((nibbles, torch.full((1,), 8, dtype=torch.uint8)))
        packed[start // 2 : start // 2 + nibbles.numel() // 2] = nibbles[0::2] | (
            nibbles[1::2] << 4
        )
    return QuantizedTensor(codes_of, scales, tuple(tensor.shape), bits, block_size)


def encode_value(value: Encoded, dtype: str, block_size: int) -> Encoded:
    """One value as the wire carries it in format ``dtype``: quantized (int8, int4; a value
    already quantized so is kept, one quantized otherwise is a ``ValueError``), cast (bf16,
    fp16) or unchanged (fp32)."""
    bits = QUANTIZED_BITS.get(dtype)
    if isinstance(value, QuantizedTensor):
        if (value.bits, value.block_size) != (bits, block_size):
            raise ValueError(
                f"a value quantized as int{value.bits}/{value.block_size} is not "
                f"{dtype}/{block_size}"
            )
        return value
    if bits is not None:
        return quantize(value, bits, block_size)
    return value.detach().to("cpu").to(DELTA_DTYPES[dtype])


def encode_delta(delta: Mapping[str, Encoded], dtype: str, block_size: int) -> dict[str, Encoded]:
    """``delta`` as the wire will carry it (:func:`encode_value` of each value).
    :func:`decode_value` of each is exactly what the master adds, so ``value -
    decode_value(encoded)`` is what a node keeps as its error-feedback residual."""
    name = (dtype or "fp32").lower()
    delta_dtype(name)
    return {key: encode_value(value, name, block_size) for key, value in delta.items()}


def decode_value(value: Encoded) -> torch.Tensor:
    """The float32 values the master adds for one encoded value (see :func:`encode_delta`)."""
    if isinstance(value, QuantizedTensor):
        return value.dequantize()
    return value.to(torch.float32)


class EncodedView(Mapping[str, "torch.Tensor | QuantizedTensor"]):
    """``source`` as the wire carries it in format ``dtype``, one tensor at a time: each
    lookup encodes that tensor (deterministically, so again gives the same codes), so a
    node never holds the whole encoded copy; :func:`write_delta` streams it to the file."""

    def __init__(self, source: Mapping[str, torch.Tensor], dtype: str, block_size: int):
        delta_dtype(dtype)
        self.source, self.dtype, self.block_size = source, dtype, int(block_size)

    def __getitem__(self, key: str) -> Encoded:
        return encode_value(self.source[key], self.dtype, self.block_size)

    def __iter__(self) -> Iterator[str]:
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)

    def keep_residual(self) -> dict[str, torch.Tensor]:
        """Turn ``source`` into what the wire leaves out (``value - decode(encoded)``), in
        place, tensor by tensor, and return it: the node's error-feedback residual, in the
        contribution's own buffers (no second copy of the model)."""
        for value in self.source.values():
            flat = value.view(-1)  # the node's own contiguous buffers
            for start, stop in value_slices(flat.numel(), self.block_size):
                part = flat[start:stop]
                part.sub_(decode_value(encode_value(part, self.dtype, self.block_size)))
        return dict(self.source)


@dataclasses.dataclass(frozen=True)
class WireCodec:
    """How a file's values are encoded, from its header: a float dtype (``bits`` None) or
    blockwise codes of ``bits`` bits in blocks of ``block_size``."""

    name: str
    bits: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> WireCodec:
        """The file's encoding; a quantized header without a valid block size is a
        ``ValueError`` (a header without ``dtype`` is a float delta, as before 2.2)."""
        name = str(metadata.get("dtype", "fp32")).lower()
        if name not in QUANTIZED_BITS:
            return cls(name)
        raw = str(metadata.get("block_size", ""))
        if not raw.isdigit() or not MIN_BLOCK_SIZE <= int(raw) <= MAX_BLOCK_SIZE:
            raise ValueError(
                f"a {name} delta needs a block_size between {MIN_BLOCK_SIZE} and "
                f"{MAX_BLOCK_SIZE} in its header, got {raw!r}"
            )
        return cls(name, QUANTIZED_BITS[name], int(raw))

    def shapes_from(
        self, metadata: Mapping[str, str], stored: Mapping[str, tuple[int, ...]]
    ) -> dict[str, tuple[int, ...]]:
        """Each value's shape, from the shapes of the file's entries (``stored``), without a
        model to ask: float values are stored as they are; a quantized file holds each
        value's codes with its scales (``ValueError`` for one without the other), int8 codes
        have the value's shape, int4 files list it in their header (``ValueError`` when it
        is missing or malformed)."""
        if self.bits is None:
            return dict(stored)
        keys = [k for k in stored if not k.endswith(SCALE_SUFFIX)]
        unpaired = set(stored) ^ {*keys, *(k + SCALE_SUFFIX for k in keys)}
        if unpaired:
            raise ValueError(
                f"codes and scales do not pair in this {self.name} delta: {sorted(unpaired)[:5]}"
            )
        if self.bits == 8:
            return {k: stored[k] for k in keys}
        try:
            listed = json.loads(metadata["shapes"])
            shapes = {str(k): tuple(int(d) for d in v) for k, v in listed.items()}
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"an int4 delta lists its tensors' shapes in its header: {exc}"
            ) from None
        if set(shapes) != set(keys) or any(d < 0 for s in shapes.values() for d in s):
            raise ValueError("an int4 delta's header shapes do not match its tensors")
        return shapes

    def read(
        self,
        key: str,
        get: Callable[[str], torch.Tensor],
        shape: tuple[int, ...],
        max_abs: float,
    ) -> torch.Tensor:
        """Check and decode ``key`` (its codes and scales read through ``get``, in that
        order) as a tensor of ``shape``: the code dtype and count, one float32 scale per
        block, scales finite, non-negative and at most ``max_abs`` / the largest code, codes
        within range (``ValueError`` naming the key). Returns float32 values."""
        assert self.bits is not None
        codes, scales = get(key), get(key + SCALE_SUFFIX)
        top, blocks = (1 << (self.bits - 1)) - 1, -(-math.prod(shape) // self.block_size)
        want = (delta_dtype(self.name), _code_shape(self.bits, tuple(shape)))
        if (codes.dtype, tuple(codes.shape)) != want:
            raise ValueError(
                f"{key}: {self.name} codes of shape {want[1]} ({want[0]}) expected, got "
                f"{codes.dtype} {tuple(codes.shape)}"
            )
        if codes.numel():
            if self.bits == 8:
                low = int(codes.min())
            else:  # two codes + 8 a byte
                low = min(int((codes & 0xF).min()), int((codes >> 4).min())) - 8
            if low < -top:
                raise ValueError(f"{key} holds a code outside [-{top}, {top}]")
        if scales.dtype != torch.float32 or tuple(scales.shape) != (blocks,):
            raise ValueError(
                f"{key}: {blocks} float32 block scales expected (block size "
                f"{self.block_size}), got {scales.dtype} {tuple(scales.shape)}"
            )
        if blocks:
            if not bool(torch.isfinite(scales).all()):
                raise ValueError(f"non-finite scales in {key}")
            if float(scales.min()) < 0:
                raise ValueError(f"{key} holds a negative scale")
            high = float(scales.max())
            if high * top > max_abs:
                raise ValueError(
                    f"{key} holds a scale of {high:.3g}: values up to {high * top:.3g}, "
                    f"beyond the bound {max_abs:g}"
                )
        quantized = QuantizedTensor(codes, scales, tuple(shape), self.bits, self.block_size)
        return quantized.dequantize()


# -- states and contributions -------------------------------------------------------------
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


def _shape(value: torch.Tensor | tuple[int, ...]) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else tuple(value)


#: A delta file's keys of the inner optimizer's first moments (``distributed.sync_inner_momentum``)
#: are this prefix + the parameter's key: never a model key (``::`` is in none).
MOMENT_PREFIX = "moment::"
V = TypeVar("V")


def is_moment(key: str) -> bool:
    """Whether a contribution's ``key`` is a first moment's, not a weight's."""
    return key.startswith(MOMENT_PREFIX)


def without_moments(values: Mapping[str, V]) -> dict[str, V]:
    """The weights' part of a contribution: ``values`` less its first moments."""
    return {k: v for k, v in values.items() if not is_moment(k)}


def check_like(
    expected: Mapping[str, torch.Tensor | tuple[int, ...]],
    got: Mapping[str, torch.Tensor | tuple[int, ...]],
    *,
    what: str,
) -> None:
    """The one check of keys and shapes: a ``ValueError`` unless ``got`` has exactly the keys
    of ``expected`` with their shapes (tensors or shapes on either side), reading
    ``<what>: missing [...], unexpected [...]`` (five of each, sorted) or ``<what>: <key> has
    shape <got>, expected <expected>``; ``what`` says what failed to match what."""
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or extra:
        raise ValueError(f"{what}: missing {missing[:5]}, unexpected {extra[:5]}")
    for key, want in expected.items():
        if _shape(want) != _shape(got[key]):
            raise ValueError(f"{what}: {key} has shape {_shape(got[key])}, expected {_shape(want)}")


def fragments_of(state: Mapping[str, torch.Tensor], parts: int) -> list[tuple[str, ...]]:
    """The floating tensors of a model's ``state_dict()`` in ``parts`` fragments (streamed
    rounds sync one each): the tensors grouped by storage (tied weights travel together),
    the groups ordered by their first key name and cut into ``parts`` runs of about equal
    size. The same model config gives the same fragments on every node. ``ValueError`` when
    there are fewer groups than ``parts``."""
    groups: dict[tuple[object, ...], list[str]] = {}
    for key, value in state.items():
        if _is_floating(value):
            identity = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
            groups.setdefault(identity, []).append(key)
    ordered = sorted((sorted(keys), state[keys[0]].numel()) for keys in groups.values())
    if len(ordered) < parts:
        raise ValueError(f"the model has {len(ordered)} tensors to split into {parts} fragments")
    total = sum(size for _, size in ordered)
    cuts: list[list[str]] = [[] for _ in range(parts)]
    done = 0
    for index, (keys, size) in enumerate(ordered):
        # about equal sizes, and never an empty fragment: as many groups left as fragments
        part = min(parts - 1, done * parts // max(total, 1), index)
        part = max(part, parts - (len(ordered) - index))
        cuts[part].extend(keys)
        done += size
    return [tuple(keys) for keys in cuts]


def compute_pseudo_gradient(
    baseline: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``float32(baseline) - float32(current)`` for every floating key (golden: [3,5]-[1,4]=[2,1]).

    Key sets must match and every shape must agree (:func:`check_like`), else ``ValueError``.
    """
    check_like(baseline, current, what="the state does not match its baseline")
    delta: dict[str, torch.Tensor] = {}
    for key, base in floating_state(baseline).items():
        b, c = base.detach().to("cpu"), current[key].detach().to("cpu")
        if b.is_complex():
            b, c = b.real, c.real
        delta[key] = b.to(torch.float32) - c.to(torch.float32)
    return delta


def average_deltas(deltas: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Equal-weight float32 mean of deltas with identical keys and shapes."""
    items = list(deltas)
    if not items:
        raise ValueError("average_deltas needs at least one delta")
    total = {
        key: value.detach().to("cpu", torch.float32, copy=True) for key, value in items[0].items()
    }
    for index, delta in enumerate(items[1:], 1):
        check_like(total, delta, what=f"delta {index} does not match delta 0")
        for key, value in delta.items():
            total[key].add_(value.detach().to("cpu", torch.float32))
    return {key: value.div_(float(len(items))) for key, value in total.items()}


def is_all_zero(delta: Mapping[str, torch.Tensor]) -> bool:
    """True when every tensor of ``delta`` is exactly zero (nothing to upload)."""
    return all(not bool(torch.count_nonzero(value)) for value in delta.values())


def first_non_finite(
    state: Mapping[str, torch.Tensor],
    like: Mapping[str, torch.Tensor] | None = None,
    *,
    max_abs: float | None = None,
) -> str | None:
    """The first floating key of ``state`` holding NaN or inf (or, with ``max_abs``, a value
    beyond ``±max_abs``), else None.

    With ``like`` (the model's state), each tensor is checked as it will be installed: cast
    to ``like``'s dtype for that key (a float64 1e300 is finite in the file and inf in a
    float32 model)."""
    for key, value in floating_state(state).items():
        target = like.get(key) if like is not None else None
        cast = target.dtype if target is not None and _is_floating(target) else value.dtype
        flat = value.reshape(-1)
        for start, stop in value_slices(flat.numel()):  # temporaries of one slice
            part = flat[start:stop].to(cast)
            if not bool(torch.isfinite(part).all()):
                return key
            if max_abs is not None and part.numel() and float(part.abs().max()) > max_abs:
                return key
    return None


@functools.cache
def _malloc_trim() -> Callable[[int], object] | None:
    """glibc's ``malloc_trim``, loaded on first use (None with another C library)."""
    with contextlib.suppress(OSError, AttributeError):
        trim: Callable[[int], object] = ctypes.CDLL(
            ctypes.util.find_library("c") or "libc.so.6"
        ).malloc_trim
        return trim
    return None


def return_free_memory(*, beside_training: bool = False) -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``): a round's
    slice-sized temporaries would otherwise stay resident, counted as the process's.

    Not ``beside_training`` (``sync: overlapped``, where rounds run while the process
    trains): glibc trims every arena, the training thread's too, whose next step then takes
    its pages back from the kernel. On the link bench (2 nodes on 2 cores, 25 rounds) that
    cost each training thread 2.3 s of kernel time and made its steps 8% slower; kept, a
    node's resident memory stays at its high-water mark (50-80 MiB more there)."""
    if beside_training:
        return
    if (trim := _malloc_trim()) is not None:
        trim(0)


# -- safetensors files --------------------------------------------------------------------
#: safetensors' names of the dtypes a state may hold.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_Layout: TypeAlias = "list[tuple[str, torch.dtype, tuple[int, ...]]]"


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
    tensors = {str(key): value for key, value in state.items()}
    layout: _Layout = []
    for key, value in tensors.items():
        out = dtype if dtype is not None and value.is_floating_point() else value.dtype
        layout.append((key, out, tuple(value.shape)))
    return _write_entries(handle, layout, tensors.__getitem__, metadata, digest_key)


def _write_entries(
    handle: BinaryIO,
    layout: _Layout,
    produce: Callable[[str], torch.Tensor],
    metadata: Mapping[str, object] | None,
    digest_key: str | None,
) -> str:
    """The safetensors writer: the header from ``layout`` (key, dtype, shape), then each
    entry's bytes as ``produce(key)`` makes them (cast to the entry's dtype), one at a time.
    With ``digest_key`` (a seekable ``handle``), the data section's sha256 is written under
    that key as a placeholder of the same width, filled in at the end: one pass."""
    seekable = digest_key is not None and handle.seekable()
    placeholder = f'"{digest_key}":"{"0" * 64}"'.encode()
    if seekable:
        metadata = {**dict(metadata or {}), str(digest_key): "0" * 64}
    header: dict[str, object] = {}
    offset = 0
    for key, out, shape in layout:
        size = math.prod(shape) * out.itemsize
        header[key] = {
            "dtype": _NAMES[out],
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
        tensor = produce(key).detach().to("cpu", out).contiguous().reshape(-1)
        if tensor.numel() != math.prod(shape):
            raise ValueError(f"{key}: {tensor.numel()} values, the header says {shape}")
        if tensor.numel():
            view = tensor.view(torch.uint8).numpy().data
            handle.write(view)
            digest.update(view)
    if seekable:  # the placeholder (one key, so unique in the header) becomes the digest
        end = handle.tell()
        handle.seek(start + 8)
        handle.write(raw.replace(placeholder, f'"{digest_key}":"{digest.hexdigest()}"'.encode(), 1))
        handle.seek(end)
    return digest.hexdigest()


class _Discard(io.RawIOBase):
    """A sink that keeps nothing (what :func:`write_safetensors` hashes is all we need)."""

    def writable(self) -> bool:
        return True

    def write(self, data: object) -> int:
        return memoryview(data).nbytes  # type: ignore[arg-type]


def safetensors_sha256(
    state: Mapping[str, torch.Tensor], *, metadata: Mapping[str, object] | None = None
) -> str:
    """The sha256 the file :func:`write_safetensors` would write of ``state`` has, written
    nowhere: whether a published file holds exactly these tensors."""
    return write_safetensors(_Discard(), state, metadata=metadata)  # type: ignore[arg-type]


class SafetensorsFile:
    """A safetensors file (a local file or bytes) read one tensor at a time with plain reads:
    no memory map, whose pages would count as the process's own. The header is checked on
    opening as the safetensors library does (known dtypes; the tensors' bytes, as long as
    shape and dtype say, tile the data section); damage is a ``ValueError``. Offers
    ``metadata()``, ``keys()``, ``shape(key)``, ``get_tensor(key)`` as ``safe_open`` does."""

    def __init__(self, handle: io.BufferedIOBase):
        size = handle.seek(0, os.SEEK_END)
        handle.seek(0)
        length = int.from_bytes(handle.read(8), "little")
        if size < 8 or length <= 0 or 8 + length > size:
            raise ValueError("not a safetensors file (bad header length)")
        try:
            header: object = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a safetensors file (bad header: {exc})") from None
        if not isinstance(header, dict):
            raise ValueError("not a safetensors file (header is not an object)")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise ValueError("not a safetensors file (its metadata is not an object)")
        self._metadata = {str(k): str(v) for k, v in metadata.items()}
        self._handle, self._start = handle, 8 + length
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            try:
                dtype = _DTYPES[info["dtype"]]
                shape = tuple(int(n) for n in info["shape"])
                begin, end = (int(n) for n in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"not a safetensors file (bad entry for {key!r})") from None
            if min(shape, default=0) < 0 or end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"not a safetensors file ({key!r} has the wrong length)")
            self._entries[str(key)] = (dtype, shape, begin, end)
        offset = 0  # the entries' bytes, in file order, must cover the data section exactly
        for _, _, begin, end in sorted(self._entries.values(), key=lambda e: (e[2], e[3])):
            if begin != offset:
                raise ValueError("not a safetensors file (tensors overlap or leave gaps)")
            offset = end
        if offset != size - self._start:
            raise ValueError("not a safetensors file (the data section has the wrong length)")

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
        return self.read_flat(key, 0, (end - begin) // dtype.itemsize).reshape(shape)

    def read_flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Values ``start`` to ``stop`` (clipped to its size) of tensor ``key`` flattened, read
        from the file into a new 1-D CPU tensor: a slice of a large tensor costs its own size."""
        dtype, _, begin, end = self._entries[key]
        first = min(begin + start * dtype.itemsize, end)
        last = min(begin + stop * dtype.itemsize, end)
        raw = torch.empty(last - first, dtype=torch.uint8)
        self._handle.seek(self._start + first)
        if last > first and self._handle.readinto(raw.numpy().data) != last - first:
            raise ValueError(f"{key} is truncated")
        return raw.view(dtype)


@contextlib.contextmanager
def open_safetensors(path: _PathArg) -> Iterator[SafetensorsFile]:
    """A local safetensors file opened for :class:`SafetensorsFile`; damage is a
    ``ValueError``."""
    with open(path, "rb") as handle:
        yield SafetensorsFile(handle)


def state_from_bytes(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of the bytes of a safetensors file; damage is a ``ValueError``."""
    opened = SafetensorsFile(io.BytesIO(data))
    return {key: opened.get_tensor(key) for key in opened}, opened.metadata()


def load_delta(path: _PathArg) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file as it is stored (a delta's values not
    decoded); damage is a ``ValueError``."""
    with open_safetensors(path) as opened:
        return {key: opened.get_tensor(key) for key in opened}, opened.metadata()


def load_safetensors(path: _PathArg) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on the CPU."""
    return load_delta(path)[0]


def file_sha256(path: Path) -> str:
    """The sha256 of the file at ``path``, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_metadata(path: _PathArg) -> dict[str, str]:
    """Header metadata of a safetensors file (``{}`` when absent)."""
    with open_safetensors(path) as opened:
        return opened.metadata()


def save_safetensors(
    state: Mapping[str, torch.Tensor],
    path: _PathArg,
    *,
    metadata: Mapping[str, object] | None = None,
) -> Path:
    """Write ``state`` to ``path`` atomically (temp file + rename), one tensor at a time."""
    return atomic_write_with(
        lambda handle: write_safetensors(handle, state, metadata=metadata), path
    )


# -- delta files --------------------------------------------------------------------------
def write_delta(
    handle: BinaryIO,
    delta: Mapping[str, Encoded],
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
    values in wire format ``dtype`` (int8/int4: blocks of ``block_size``, default
    :data:`DEFAULT_BLOCK_SIZE`; a :class:`QuantizedTensor` is written as it is).
    ``round_index`` is the round it is meant for (default ``base_outer_step``),
    ``local_step`` the node's optimizer step when it was taken."""
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
    if name in QUANTIZED_BITS:
        block = int(block_size or DEFAULT_BLOCK_SIZE)
        write_quantized(handle, delta, name, block, metadata, digest_key=DATA_DIGEST)
        return
    floats = {key: value for key, value in delta.items() if isinstance(value, torch.Tensor)}
    if len(floats) != len(delta):
        raise ValueError(f"a {name} delta holds float values, not codes")
    wire = DELTA_DTYPES[name]
    write_safetensors(handle, floats, metadata=metadata, dtype=wire, digest_key=DATA_DIGEST)


def write_quantized(
    handle: BinaryIO,
    values: Mapping[str, Encoded],
    dtype: str,
    block_size: int,
    metadata: Mapping[str, object],
    *,
    digest_key: str | None = None,
) -> str:
    """Write ``values`` blockwise-quantized (``int8``/``int4``; a float tensor quantized as
    it is written) with ``metadata``, the block size and, for int4 (packed codes lose it),
    every shape: each tensor's codes under its key, its scales beside it. Returns the sha256
    of the file (with ``digest_key``, of the data section, as :func:`write_safetensors`)."""
    bits = QUANTIZED_BITS[dtype]
    layout: _Layout = []
    shapes: dict[str, list[int]] = {}
    for key, value in values.items():
        shape = tuple(value.shape)
        layout.append((str(key), delta_dtype(dtype), _code_shape(bits, shape)))
        layout.append(
            (str(key) + SCALE_SUFFIX, torch.float32, (-(-math.prod(shape) // block_size),))
        )
        shapes[str(key)] = list(shape)
    header = {**metadata, "block_size": str(block_size)}
    if dtype == "int4":
        header["shapes"] = json.dumps(shapes, sort_keys=True, separators=(",", ":"))
    last: list[QuantizedTensor] = []  # the tensor being written: its codes, then its scales

    def produce(key: str) -> torch.Tensor:
        if key.endswith(SCALE_SUFFIX):
            return last.pop().scales
        value = encode_value(values[key], dtype, block_size)
        assert isinstance(value, QuantizedTensor)
        last.append(value)
        return value.codes

    return _write_entries(handle, layout, produce, header, digest_key)


_P = ParamSpec("_P")


def _in_memory(write: Callable[Concatenate[BinaryIO, _P], object]) -> Callable[_P, bytes]:
    """The bytes the writer ``write`` writes, in memory."""

    def to_bytes(*args: _P.args, **kwargs: _P.kwargs) -> bytes:
        buffer = io.BytesIO()
        write(buffer, *args, **kwargs)
        return buffer.getvalue()

    to_bytes.__doc__ = f"The bytes :func:`{write.__name__}` writes (same arguments, no handle)."
    return to_bytes


#: The bytes of a safetensors file of ``state`` (the arguments of :func:`write_safetensors`).
state_to_bytes = _in_memory(write_safetensors)
#: The bytes of a delta file (the arguments of :func:`write_delta`).
delta_to_bytes = _in_memory(write_delta)


def delta_from_bytes(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse a delta file without a model to compare with: ``(values as float32, metadata)``
    (see :meth:`DeltaReader.values`); damage is a ``ValueError``."""
    reader = DeltaReader(SafetensorsFile(io.BytesIO(data)))
    return reader.values(), reader.metadata


class DeltaReader:
    """A delta file opened once: :meth:`check` validates it against the model tensor by
    tensor, :meth:`add_to` folds it into a running sum, :meth:`values` decodes it whole; a
    float delta is read a slice at a time, a quantized one a tensor at a time."""

    def __init__(self, opened: SafetensorsFile):
        self._file = opened
        self.metadata = opened.metadata()

    def _layout(self) -> tuple[WireCodec, dict[str, tuple[int, ...]]]:
        """The file's encoding and each value's shape; float values must be in a wire dtype."""
        codec = WireCodec.from_metadata(self.metadata)
        shapes = codec.shapes_from(self.metadata, {k: self._file.shape(k) for k in self._file})
        for key in shapes if codec.bits is None else ():
            if self._file.dtype(key) not in DELTA_DTYPES.values():
                raise ValueError(
                    f"{key} is {self._file.dtype(key)}; a delta holds fp32, bf16 or fp16 values"
                )
        return codec, shapes

    def _check_digest(self) -> None:
        """A ``ValueError`` unless the data hashes to the digest the header names, if any."""
        named = self.metadata.get(DATA_DIGEST)
        if named is not None and (actual := self._file.data_sha256()) != named:
            raise ValueError(
                f"its values do not match the digest in its header ({DATA_DIGEST} "
                f"{named[:12]}..., the data hashes to {actual[:12]}...): changed or damaged "
                "after it was written"
            )

    def check(
        self,
        reference: Mapping[str, torch.Tensor],
        *,
        max_abs: float = MAX_DELTA_ABS,
        partial: bool = False,
    ) -> str:
        """Check the file against the floating part of ``reference``: its keys and shapes
        (:func:`check_like`; ``partial``: a fragment's, some of the model's keys with their
        shapes), the wire dtypes, finite values within ``max_abs`` (quantized: the checks of
        :meth:`WireCodec.read`, so no decoded value exceeds ``max_abs``), then the digest the
        header names (:data:`DATA_DIGEST`); ``ValueError`` naming the problem. Returns the
        sha256 of the values (a re-sent copy has the same digest)."""
        codec, shapes = self._layout()
        model = {key: tuple(value.shape) for key, value in floating_state(reference).items()}
        moments = {k: v for k, v in shapes.items() if is_moment(k)}
        values = {k: v for k, v in shapes.items() if k not in moments}
        if partial and values:  # a fragment: the model's tensors it names, no others
            model = {k: v for k, v in model.items() if k in values} or model
        check_like(model, values, what="the delta does not match the model")
        for key, shape in moments.items():  # a first moment: of a model tensor, its shape
            if model.get(key[len(MOMENT_PREFIX) :]) != tuple(shape):
                raise ValueError(f"{key} is no first moment of a model tensor of its shape")
        digest = hashlib.sha256()

        def hashed(name: str) -> torch.Tensor:  # a tensor read, and added to the digest
            value = self._file.get_tensor(name)
            digest.update(name.encode("utf-8"))
            digest.update(value.reshape(-1).view(torch.uint8).numpy().data)
            return value

        for key in sorted(shapes):
            if codec.bits is not None:
                codec.read(key, hashed, shapes[key], max_abs)
                continue
            digest.update(key.encode("utf-8"))
            peak = 0.0
            for start, stop in value_slices(math.prod(shapes[key])):  # one slice in memory
                part = self._file.read_flat(key, start, stop)
                if not bool(torch.isfinite(part).all()):
                    raise ValueError(f"non-finite values in {key}")
                peak = max(peak, float(part.abs().max()))
                digest.update(part.view(torch.uint8).numpy().data)
            if peak > max_abs:
                raise ValueError(f"{key} holds {peak:.3g}, beyond the bound {max_abs:g}")
        self._check_digest()  # last: a bad value is named for what it is
        return digest.hexdigest()

    def moment_keys(self) -> list[str]:
        """The names of the first moments the file carries (``MOMENT_PREFIX`` + a model key)."""
        return sorted(k for k in self._layout()[1] if is_moment(k))

    def values(self) -> dict[str, torch.Tensor]:
        """Every value as float32 (the master aggregates in fp32), without a model: float
        values must be in a wire dtype (an integer or boolean tensor is a ``ValueError``,
        never converted), quantized ones pass :meth:`WireCodec.read`; then the digest."""
        codec, shapes = self._layout()
        get = self._file.get_tensor
        if codec.bits is None:
            values = {key: get(key).to(torch.float32) for key in shapes}
        else:
            values = {k: codec.read(k, get, s, MAX_DELTA_ABS) for k, s in shapes.items()}
        self._check_digest()
        return values

    def model_keys(self) -> list[str]:
        """The model tensors the file holds values of (all of them, or a fragment's)."""
        return sorted(k for k in self._layout()[1] if not is_moment(k))

    def add_to(
        self,
        total: dict[str, torch.Tensor],
        scale: float | Mapping[str, float] = 1.0,
        observe: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """``total[key] += scale * value`` in float32 for every key of ``total`` the file holds
        (the file checked first; ``scale`` one number or one per key); a quantized file is
        decoded one tensor at a time. ``observe`` sees every decoded float32 slice before it
        is scaled (the adaptive outer step's norms)."""
        codec = WireCodec.from_metadata(self.metadata)
        held = set(self._layout()[1])  # a fragment's tensors (or every one), first moments
        for key in sorted(k for k in total if k in held):
            alpha = scale if isinstance(scale, float | int) else scale[key]
            if codec.bits is not None:
                shape = tuple(total[key].shape)
                value = codec.read(key, self._file.get_tensor, shape, MAX_DELTA_ABS)
                if observe is not None:
                    observe(value)
                total[key].add_(value, alpha=alpha)
                continue
            flat = total[key].view(-1)
            for start, stop in value_slices(flat.numel()):
                part = self._file.read_flat(key, start, stop).to(torch.float32)
                if observe is not None:
                    observe(part)
                flat[start:stop].add_(part, alpha=alpha)


@contextlib.contextmanager
def open_delta(path: _PathArg) -> Iterator[DeltaReader]:
    """A local delta file opened for :class:`DeltaReader`; an unreadable file is a
    ``ValueError``."""
    with open(path, "rb") as handle:
        try:
            reader = DeltaReader(SafetensorsFile(handle))
        except ValueError as exc:
            raise ValueError(f"not a safetensors delta: {exc}") from None
        yield reader


@dataclasses.dataclass
class OuterUpdate:
    """One round's outer update: it turns the global of ``base_step`` (``base_digest``) into
    the one of ``outer_step`` (``digest``). Quantized (``dtype`` int8/int4): ``encoded``, the
    step of each tensor, added to the old values; ``dtype`` fp32 (a streamed round of an fp32
    global, :func:`exact_update`): ``exact``, the new values of the tensors the round moved,
    which replace the old ones (a difference would not add back to the same bits)."""

    encoded: dict[str, QuantizedTensor]
    dtype: str
    block_size: int
    base_step: int
    base_digest: str
    outer_step: int = -1
    digest: str = ""
    run_id: str = ""
    exact: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def write(self, handle: BinaryIO) -> str:
        """Write the update file (codes and scales, as deltas; or the exact new values) to
        ``handle``; its sha256."""
        header: dict[str, object] = {
            "kind": "outer_update",
            "dtype": self.dtype,
            "outer_step": self.outer_step,
            "run_id": self.run_id,
            "base_outer_step": self.base_step,
            "base_digest": self.base_digest,
            "digest": self.digest,
        }
        if self.dtype == "fp32":
            return write_safetensors(handle, self.exact, metadata=header)
        return write_quantized(handle, self.encoded, self.dtype, self.block_size, header)


def exact_update(
    state: Mapping[str, torch.Tensor], keys: Iterable[str], base_step: int, base_digest: str
) -> OuterUpdate:
    """The fp32 outer update of a streamed round: the new values of ``state``'s tensors
    ``keys`` (copies), made from global ``base_step`` (``base_digest``)."""
    exact = {key: state[key].detach().to("cpu").clone() for key in keys}
    return OuterUpdate({}, "fp32", 0, base_step, base_digest, exact=exact)


# -- the compressed global: a node applies the master's outer update --------------------
def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 of a state's names, dtypes, shapes and bytes (keys in sorted order)."""
    digest = hashlib.sha256()
    for key in sorted(state):
        value = state[key].detach().to("cpu").contiguous()
        digest.update(f"{key}|{value.dtype}|{tuple(value.shape)}|".encode())
        if value.numel():
            digest.update(value.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def average_states(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The mean of ``states`` key by key: summed in float32 in the given order, divided by
    their number, cast back to the first state's dtypes; non-floating values (counters) are
    the last state's."""
    if not states:
        raise ValueError("nothing to average")
    last = states[-1]
    result: dict[str, torch.Tensor] = {}
    for key, value in states[0].items():
        if not value.is_floating_point():
            result[key] = last[key].clone()
            continue
        total = value.detach().to("cpu", torch.float32, copy=True)
        for state in states[1:]:
            total.add_(state[key].detach().to("cpu", torch.float32))
        result[key] = total.div_(float(len(states))).to(value.dtype)
    return result


def add_decoded(base: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """``base + decoded`` in float32, in ``base``'s dtype: the one addition the master and
    every node perform, so they hold the same bits."""
    return (base.detach().to("cpu", torch.float32) + decoded).to(base.dtype)


@dataclasses.dataclass
class HeldGlobal:
    """The last global a node installed, kept to apply the next update to (the tensors the
    node was handed, not a copy: the install only reads them)."""

    outer_step: int
    run_id: str
    digest: str
    state: dict[str, torch.Tensor]

    @classmethod
    def of(cls, outer_step: int, run_id: str, state: Mapping[str, torch.Tensor]) -> HeldGlobal:
        """``state`` held as global ``outer_step`` of run ``run_id`` (its digest computed)."""
        return cls(outer_step, run_id, state_digest(state), dict(state))


def read_update(
    path: _PathArg,
    held: HeldGlobal,
    *,
    sha256: str,
    outer_step: int,
    run_id: str,
    like: Mapping[str, torch.Tensor],
) -> HeldGlobal:
    """Global ``outer_step`` of run ``run_id``, from ``held`` and the update file at ``path``.
    The file must be the one the version record names (``sha256``), an update (codes and
    scales checked as a delta's) from ``held`` (outer step, run id, digest) to this global,
    its result must have the digest it announces and be finite in the model's dtypes
    ``like``; else ``ValueError``."""
    if file_sha256(Path(path)) != sha256:
        raise ValueError("the update file does not match the version record (sha256)")
    with open_safetensors(path) as opened:
        header = opened.metadata()
        if header.get("kind") != "outer_update":
            raise ValueError("not an outer update file")
        base = (header.get("base_outer_step"), header.get("base_digest"))
        if base != (str(held.outer_step), held.digest) or held.run_id != run_id:
            raise ValueError(
                f"the update applies to global {base[0]} ({str(base[1])[:12]}), this node holds "
                f"{held.outer_step} ({held.digest[:12]}) of run {held.run_id or '?'}"
            )
        made = (header.get("outer_step"), header.get("run_id"))
        if made != (str(outer_step), run_id):
            raise ValueError(
                f"the update makes global {made[0]} of run {made[1] or '?'}; the record names "
                f"{outer_step} of {run_id or '?'}"
            )
        fmt = WireCodec.from_metadata(header)
        if fmt.bits is None and fmt.name != "fp32":
            raise ValueError(f"an update holds int8 or int4 codes or fp32 values, not {fmt.name}")
        # every floating tensor of the global, or a fragment's (streamed rounds)
        named = set(opened.keys())
        floating = [k for k, v in held.state.items() if v.is_floating_point() and k in named]
        scales = {k + SCALE_SUFFIX for k in floating} if fmt.bits is not None else set()
        if not floating or named != set(floating) | scales:
            raise ValueError("the update's keys do not match the global's floating tensors")
        result = dict(held.state)
        if fmt.bits is None:  # the new values themselves: the global's shapes and dtypes
            result.update(_exact_values(opened, {k: held.state[k] for k in floating}))
        else:  # codes (dtype, count, range) and scales (count, finite, bound), as a delta's
            for key in floating:
                value = held.state[key]
                decoded = fmt.read(key, opened.get_tensor, tuple(value.shape), MAX_DELTA_ABS)
                result[key] = add_decoded(value, decoded)
    digest = state_digest(result)
    if digest != header.get("digest"):
        raise ValueError("the result differs from the master's global (digest)")
    bad = first_non_finite(result, like=like)
    if bad is not None:
        raise ValueError(f"the updated global holds non-finite values in {bad}")
    return HeldGlobal(outer_step, run_id, digest, result)


def _exact_values(
    opened: SafetensorsFile, old: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """An fp32 update's new values of the tensors ``old`` names, read from ``opened``: each
    with its old tensor's shape (:func:`check_like`) and dtype; else ``ValueError``."""
    values = {key: opened.get_tensor(key) for key in old}
    check_like(old, values, what="the update's values do not fit the global's tensors")
    for key, value in values.items():
        if value.dtype != old[key].dtype:
            raise ValueError(f"the update's {key} is {value.dtype}, the global's {old[key].dtype}")
    return values
