"""The global's download compressed: the round's outer update, quantized, on top of the last global.

``distributed.global_dtype: int8`` (or ``int4``). The master closes round r as before, then::

    update        = (global_{r+1} - global_r) + residual       # float32, per floating tensor
    sent          = quantize(update)                           # blockwise codes, as deltas
    residual      = update - decode(sent)                      # error feedback (switchable)
    global_{r+1} := add_decoded(global_r, decode(sent))        # what it keeps and publishes

and publishes ``global/update.safetensors`` (``sent``; its header names the global it applies
to: outer step, run id and :func:`state_digest`, and the digest of the result) beside the
full global, in the same commit; the version record names the update's sha256. A node that
holds global r computes ``add_decoded(global_r, decode(sent))``: the same float32 additions
on the same values, so bit for bit the master's global r+1, which the result's digest
confirms. A node without global r (a joiner, a resumed node, one that missed a round), or
with an update it cannot use (damaged, of another base, a digest that differs), downloads
the full global instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any, BinaryIO

import torch

from speedtronic.diloco import codec as wire
from speedtronic.diloco import exchange as T
from speedtronic.diloco.codec import (
    QUANTIZED_BITS,
    SCALE_SUFFIX,
    QuantizedTensor,
    WireCodec,
    quantize,
)

__all__ = [
    "GLOBAL_UPDATE",
    "HeldGlobal",
    "OuterUpdate",
    "add_decoded",
    "apply_update",
    "read_update",
    "state_digest",
    "step_quantized",
]

#: Where the master publishes the quantized outer update (beside ``global/latest``).
GLOBAL_UPDATE = T.GLOBAL_UPDATE
_KIND = "outer_update"


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 of a state's names, dtypes, shapes and bytes (keys in sorted order)."""
    digest = hashlib.sha256()
    for key in sorted(state):
        value = state[key].detach().to("cpu").contiguous()
        digest.update(f"{key}|{value.dtype}|{tuple(value.shape)}|".encode())
        if value.numel():
            digest.update(value.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def add_decoded(base: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """``base + decoded`` in float32, in ``base``'s dtype: the one addition the master and
    every node perform, so they hold the same bits."""
    return (base.detach().to("cpu", torch.float32) + decoded).to(base.dtype)


@dataclasses.dataclass
class OuterUpdate:
    """One round's quantized outer update: ``encoded`` (key -> QuantizedTensor) turns the
    global of ``base_step`` (``base_digest``) into the one of ``outer_step`` (``digest``)."""

    encoded: dict[str, QuantizedTensor]
    dtype: str
    block_size: int
    base_step: int
    base_digest: str
    outer_step: int = -1
    digest: str = ""
    run_id: str = ""

    def write(self, handle: BinaryIO) -> str:
        """Write the update file (the delta container: codes, scales) to ``handle``; returns
        its sha256."""
        header: dict[str, object] = {
            "kind": _KIND,
            "dtype": self.dtype,
            "outer_step": self.outer_step,
            "run_id": self.run_id,
            "base_outer_step": self.base_step,
            "base_digest": self.base_digest,
            "digest": self.digest,
        }
        return wire.write_quantized(handle, self.encoded, self.dtype, self.block_size, header)


@torch.no_grad()
def step_quantized(
    optimizer: Any,
    state: dict[str, torch.Tensor],
    mean: Mapping[str, torch.Tensor],
    residual: dict[str, torch.Tensor],
    *,
    dtype: str,
    block_size: int,
    error_feedback: bool,
) -> OuterUpdate:
    """The outer step of ``optimizer`` on ``state`` (in place, a tensor at a time), with the
    step's update quantized: ``state`` ends as ``add_decoded(previous, decode(sent))``;
    ``residual`` (updated in place) is what ``sent`` left out (kept only with
    ``error_feedback``). Temporaries: one tensor's copies at a time."""
    bits = QUANTIZED_BITS[dtype]
    base_digest = state_digest(state)
    encoded: dict[str, QuantizedTensor] = {}
    for key in mean:
        weight = state[key]
        if not weight.is_floating_point():
            continue
        previous = weight.detach().clone()
        optimizer.step({key: weight}, {key: mean[key]})
        update = weight.to(torch.float32) - previous.to(torch.float32)
        if key in residual:
            update.add_(residual[key])
        sent = quantize(update, bits, block_size)
        decoded = sent.dequantize()
        if error_feedback:
            residual[key] = update.sub_(decoded)
        weight.copy_(add_decoded(previous, decoded))
        encoded[key] = sent
    return OuterUpdate(encoded, dtype, block_size, -1, base_digest)


@dataclasses.dataclass
class HeldGlobal:
    """The last global a node installed, kept to apply the next update to. ``state`` is the
    same tensors the node was handed, not a copy: the install only reads them (it copies
    their values into the model and the anchor), so they stay the global's bits."""

    outer_step: int
    run_id: str
    digest: str
    state: dict[str, torch.Tensor]

    @classmethod
    def of(cls, outer_step: int, run_id: str, state: Mapping[str, torch.Tensor]) -> HeldGlobal:
        """``state`` held as global ``outer_step`` of run ``run_id`` (its digest computed)."""
        return cls(outer_step, run_id, state_digest(state), dict(state))


def apply_update(
    opened: wire.SafetensorsFile, held: HeldGlobal, *, outer_step: int, run_id: str
) -> HeldGlobal:
    """Global ``outer_step`` of ``run_id`` from ``held`` and the update file ``opened``, held
    with its checked digest (``held`` is not changed). ``ValueError`` unless the update is
    one (kind, codes, block count, finite bounded scales as for deltas), names this global
    and ``held`` as its base (outer step, run id, digest), and its result has the digest it
    announces."""
    header = opened.metadata()
    if header.get("kind") != _KIND:
        raise ValueError("not an outer update file")
    base = (header.get("base_outer_step"), header.get("base_digest"))
    if base != (str(held.outer_step), held.digest) or held.run_id != run_id:
        raise ValueError(
            f"the update applies to global {base[0]} ({str(base[1])[:12]}), this node holds "
            f"{held.outer_step} ({held.digest[:12]}) of run {held.run_id or '?'}"
        )
    if (header.get("outer_step"), header.get("run_id")) != (str(outer_step), run_id):
        raise ValueError(
            f"the update makes global {header.get('outer_step')} of run "
            f"{header.get('run_id') or '?'}; the record names {outer_step} of {run_id or '?'}"
        )
    codec = WireCodec.from_metadata(header)
    if codec.bits is None:
        raise ValueError(f"an update holds int8 or int4 codes, not {codec.name}")
    floating = [k for k, v in held.state.items() if v.is_floating_point()]
    if set(opened.keys()) != set(floating) | {k + SCALE_SUFFIX for k in floating}:
        raise ValueError("the update's keys do not match the global's floating tensors")
    result = dict(held.state)
    for key in floating:  # codes (dtype, count, range) and scales (count, finite, bound)
        value = held.state[key]
        decoded = codec.read(key, opened.get_tensor, tuple(value.shape), wire.MAX_DELTA_ABS)
        result[key] = add_decoded(value, decoded)
    digest = state_digest(result)
    if digest != header.get("digest"):
        raise ValueError("the result differs from the master's global (digest)")
    return HeldGlobal(outer_step, run_id, digest, result)


def read_update(
    path: Any,
    held: HeldGlobal,
    *,
    metadata: T.GlobalMetadata,
    like: Mapping[str, torch.Tensor],
) -> HeldGlobal:
    """The global ``metadata`` names, from ``held`` and the update file at ``path`` (a local
    copy): the file must be the one the record names (sha256) and pass :func:`apply_update`,
    and the result must be finite in the model's dtypes (``like``); else ``ValueError``."""
    if T.file_sha256(path) != metadata.update_sha256:
        raise ValueError(f"{GLOBAL_UPDATE} does not match the version record (sha256)")
    with wire.open_safetensors(path) as opened:
        result = apply_update(opened, held, outer_step=metadata.outer_step, run_id=metadata.run_id)
    bad = wire.first_non_finite(result.state, like=like)
    if bad is not None:
        raise ValueError(f"the updated global holds non-finite values in {bad}")
    return result
