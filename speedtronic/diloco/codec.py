"""How a contribution's values are encoded on the wire, one tensor at a time.

The formats of ``distributed.delta_dtype``: fp32, bf16 and fp16 are casts; int8 and int4 are
blockwise symmetric codes with one float32 scale per block of ``block_size`` values. This
module holds those format names, the quantizer and its inverse, the encoding of a whole
contribution (:func:`encode_delta`, :class:`EncodedView`), the check and decoding of a
quantized file's codes and scales (:class:`WireCodec`), and the slicing that keeps the
temporaries of a large tensor near 1 MiB. The files that carry the values are
:mod:`.wire`'s; this module imports nothing else of the package.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping

import torch

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DELTA_DTYPES",
    "DELTA_FORMATS",
    "QUANTIZED_BITS",
    "SCALE_SUFFIX",
    "EncodedView",
    "QuantizedTensor",
    "WireCodec",
    "decode_value",
    "delta_dtype",
    "encode_delta",
    "encode_value",
    "quantize",
    "value_slices",
]


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


def delta_dtype(name: str | None) -> torch.dtype:
    """Map ``fp32|bf16|fp16`` (None -> fp32) to the torch dtype of its values, and ``int8`` /
    ``int4`` to the dtype of their codes (``int8``; ``uint8`` holding two 4-bit codes per
    byte); anything else is a ValueError."""
    key = (name or "fp32").lower()
    if key == "int8":
        return torch.int8
    if key == "int4":
        return torch.uint8
    if key not in DELTA_DTYPES:
        raise ValueError(
            f"distributed.delta_dtype must be one of {list(DELTA_FORMATS)}, got {name!r}"
        )
    return DELTA_DTYPES[key]


# -- quantized deltas ---------------------------------------------------------------------
#: Values per float32 scale when ``distributed.delta_block_size`` does not say (measured in
#: docs/diloco.md, "Compressed deltas": 128 keeps int8 under 0.26x and int4 under 0.14x of
#: the fp32 bytes at the quality of smaller blocks).
DEFAULT_BLOCK_SIZE = 128
#: Block sizes a file may declare (the config's bounds).
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 1 << 20
#: Key suffix of a tensor's block scales in a quantized delta file.
SCALE_SUFFIX = "::scale"


#: Values of a delta read at a time (fp32: 1 MiB): a slice, not a whole tensor, in memory.
READ_SLICE = 1 << 18


def value_slices(numel: int, size: int | None = None) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive slices of at most ``size`` (default
    :data:`READ_SLICE`) values covering ``numel``: how large tensors are worked on, so that
    temporaries stay ~1 MiB whatever the model."""
    step = int(size or READ_SLICE)
    for start in range(0, numel, step):
        yield start, min(start + step, numel)


def _largest_code(bits: int) -> int:
    """The largest code magnitude of a ``bits``-bit symmetric quantizer (127, 7)."""
    return (1 << (bits - 1)) - 1


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
        (decoded a slice of blocks at a time: temporaries of ~1 MiB)."""
        numel = math.prod(self.shape)
        flat = self.codes.reshape(-1)
        out = torch.empty(numel, dtype=torch.float32)
        for start, stop in quantizer_slices(numel, self.block_size):
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


#: Values the quantizer takes at once (rounded to whole blocks): its temporaries stay ~1 MiB
#: whatever the tensor, and the codes are the same as the whole tensor's (blocks are local).
QUANTIZER_SLICE = 1 << 18


def quantizer_slices(numel: int, block_size: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive slices of whole blocks (an even number of values, so
    4-bit codes pack within a slice), covering ``numel`` values."""
    step = block_size * max(1, QUANTIZER_SLICE // block_size)
    yield from value_slices(numel, step * (1 + step % 2))


def quantize(tensor: torch.Tensor, bits: int, block_size: int) -> QuantizedTensor:
    """Blockwise symmetric absmax quantization of ``tensor`` (float32 arithmetic, round half
    to even: deterministic, so a node and the ideal arithmetic send the same codes), a slice
    of blocks at a time."""
    flat = tensor.detach().to("cpu", torch.float32).reshape(-1)
    numel = flat.numel()
    top = _largest_code(bits)
    scales = torch.empty(-(-numel // block_size), dtype=torch.float32)
    packed = torch.empty(numel if bits == 8 else -(-numel // 2), dtype=delta_dtype(f"int{bits}"))
    for start, stop in quantizer_slices(numel, block_size):
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
    if bits == 8:
        packed = packed.reshape(tuple(tensor.shape))
    return QuantizedTensor(packed, scales, tuple(tensor.shape), bits, block_size)


def encode_delta(
    delta: Mapping[str, torch.Tensor | QuantizedTensor], dtype: str, block_size: int
) -> dict[str, torch.Tensor | QuantizedTensor]:
    """``delta`` as the wire will carry it: quantized (int8, int4; a value already quantized
    is kept), cast (bf16, fp16) or unchanged (fp32). :func:`decode_value` of each value is
    exactly what the master adds, so ``value - decode_value(encoded)`` is what a node keeps
    as its error-feedback residual."""
    name = (dtype or "fp32").lower()
    delta_dtype(name)
    bits = QUANTIZED_BITS.get(name)
    out: dict[str, torch.Tensor | QuantizedTensor] = {}
    for key, value in delta.items():
        if isinstance(value, QuantizedTensor):
            if value.bits != bits or value.block_size != block_size:
                raise ValueError(f"{key} is quantized otherwise than {name}/{block_size}")
            out[key] = value
        else:
            out[key] = encode_value(value, name, block_size)
    return out


def encode_value(
    value: torch.Tensor, dtype: str, block_size: int
) -> torch.Tensor | QuantizedTensor:
    """One float tensor as the wire carries it in format ``dtype`` (see :func:`encode_delta`)."""
    bits = QUANTIZED_BITS.get(dtype)
    if bits is not None:
        return quantize(value, bits, block_size)
    return value.detach().to("cpu").to(DELTA_DTYPES[dtype])


def decode_value(value: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    """The float32 values the master adds for one encoded tensor (see :func:`encode_delta`)."""
    if isinstance(value, QuantizedTensor):
        return value.dequantize()
    return value.to(torch.float32)


@dataclasses.dataclass(frozen=True)
class WireCodec:
    """How a delta file's values are encoded, from its header: a float dtype (``bits``
    None) or blockwise codes of ``bits`` bits in blocks of ``block_size``."""

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
        self, metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, tuple[int, ...]]:
        """Each value key's shape, without a model to ask: int8 codes carry it, int4 files
        list it in their header (``ValueError`` when it is missing or malformed)."""
        keys = [k for k in tensors if not k.endswith(SCALE_SUFFIX)]
        if self.bits == 8:
            return {k: tuple(tensors[k].shape) for k in keys}
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
        """Check and decode ``key`` (its codes and scales read through ``get``) as a tensor
        of ``shape``: the code dtype and count, one float32 scale per block, scales finite,
        non-negative and at most ``max_abs`` / the largest code, codes within range
        (``ValueError`` naming the key). Returns float32 values."""
        assert self.bits is not None
        codes, scales = get(key), get(key + SCALE_SUFFIX)
        numel = math.prod(shape)
        top = _largest_code(self.bits)
        if self.bits == 8:
            if codes.dtype != torch.int8 or tuple(codes.shape) != tuple(shape):
                raise ValueError(
                    f"{key}: int8 codes of shape {tuple(shape)} expected, got {codes.dtype} "
                    f"{tuple(codes.shape)}"
                )
            if numel and int(codes.min()) < -top:
                raise ValueError(f"{key} holds a code outside [-{top}, {top}]")
        else:
            want = (-(-numel // 2),)
            if codes.dtype != torch.uint8 or tuple(codes.shape) != want:
                raise ValueError(
                    f"{key}: {want[0]} bytes of packed int4 codes expected, got {codes.dtype} "
                    f"{tuple(codes.shape)}"
                )
            if codes.numel():
                low, high = codes & 0xF, codes >> 4
                if int(low.min()) < 8 - top or int(high.min()) < 8 - top:
                    raise ValueError(f"{key} holds a code outside [-{top}, {top}]")
        blocks = -(-numel // self.block_size)
        if scales.dtype != torch.float32 or tuple(scales.shape) != (blocks,):
            raise ValueError(
                f"{key}: {blocks} float32 block scales expected (block size "
                f"{self.block_size}), got {scales.dtype} {tuple(scales.shape)}"
            )
        if blocks:
            if not bool(torch.isfinite(scales).all()):
                raise ValueError(f"non-finite scales in {key}")
            low, high = float(scales.min()), float(scales.max())
            if low < 0:
                raise ValueError(f"{key} holds a negative scale")
            if high * top > max_abs:
                raise ValueError(
                    f"{key} holds a scale of {high:.3g}: values up to {high * top:.3g}, "
                    f"beyond the bound {max_abs:g}"
                )
        quantized = QuantizedTensor(codes, scales, tuple(shape), self.bits, self.block_size)
        return quantized.dequantize()


class EncodedView(Mapping[str, "torch.Tensor | QuantizedTensor"]):
    """``source`` as the wire carries it in format ``dtype``, one tensor at a time: each
    lookup encodes that tensor (deterministically, so again gives the same codes), so a
    node never holds the whole encoded copy; :func:`.wire.write_delta` streams it to the file."""

    def __init__(self, source: Mapping[str, torch.Tensor], dtype: str, block_size: int):
        delta_dtype(dtype)
        self.source, self.dtype, self.block_size = source, dtype, int(block_size)

    def __getitem__(self, key: str) -> torch.Tensor | QuantizedTensor:
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
            for start, stop in quantizer_slices(flat.numel(), self.block_size):
                part = flat[start:stop]
                part.sub_(decode_value(encode_value(part, self.dtype, self.block_size)))
        return dict(self.source)
