"""Device and mixed-precision resolution: which device, which autocast dtype, which scaler.

Mixed precision is autocast-only: parameters and optimizer state stay fp32 ("master weights"),
matmuls run in the autocast dtype. A ``GradScaler`` exists only for fp16 on CUDA.

| device | request        | mode | scaler | autocast |
|--------|----------------|------|--------|----------|
| CUDA   | auto (bf16 ok) | bf16 | no     | yes      |
| CUDA   | auto (no bf16) | fp16 | yes    | yes      |
| CUDA   | bf16 (not ok)  | fp32 | no     | no       |
| CUDA   | fp16           | fp16 | yes    | yes      |
| CPU    | auto/fp32/fp16 | fp32 | no     | no       |
| CPU    | bf16           | bf16 | no     | yes      |
| MPS    | anything       | fp32 | no     | no       |
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from speedtronic.config import PrecisionConfig

__all__ = [
    "PrecisionPlan",
    "autocast_context",
    "make_grad_scaler",
    "parameter_count",
    "resolve_device",
    "resolve_precision",
]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "32": "fp32",
}


@dataclass(frozen=True)
class PrecisionPlan:
    """The resolved precision of a run.

    ``mode`` is ``bf16``, ``fp16`` or ``fp32``; ``dtype`` the autocast dtype; ``use_scaler`` is
    true only for CUDA fp16; ``device_type`` is the ``torch.device.type`` it was resolved for.
    """

    mode: str
    dtype: torch.dtype
    use_scaler: bool
    autocast_enabled: bool
    device_type: str

    @property
    def is_mixed_precision(self) -> bool:
        """True for bf16 and fp16."""
        return self.mode in {"bf16", "fp16"}


def resolve_device(requested: str | torch.device | None = "auto") -> torch.device:
    """Turn ``run.device`` into a ``torch.device``.

    ``auto``/``None`` picks CUDA, then MPS, then CPU. An explicit ``cuda``/``mps`` that is not
    available raises ``RuntimeError`` (the runtime turns it into a ``ConfigError`` naming
    ``run.device``).
    """
    if requested is None or str(requested).lower() == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("CUDA was requested but is not available")
    if device.type == "mps" and not _mps_available():
        raise RuntimeError("MPS was requested but is not available")
    return device


def _mps_available() -> bool:
    try:
        return bool(torch.backends.mps.is_available())
    except Exception:  # pragma: no cover - exotic builds
        return False


def _cuda_bf16_supported() -> bool:
    try:
        return bool(torch.cuda.is_bf16_supported())
    except Exception:
        return False


def resolve_precision(
    config: PrecisionConfig | str | None, device: torch.device | str
) -> PrecisionPlan:
    """Resolve ``precision.mode`` (and ``dtype`` for ``auto``) for ``device``.

    ``config`` is a ``PrecisionConfig``, a bare mode string, or ``None`` (= auto).
    Unsupported combinations fall back as in the module table; an unknown mode raises
    ``ValueError`` naming ``precision.mode``.
    """
    device = torch.device(device)
    if config is None or isinstance(config, str):
        requested, dtype_hint = str(config or "auto").lower(), None
    else:
        requested, dtype_hint = str(config.mode).lower(), config.dtype
    if requested == "auto" and dtype_hint:
        requested = str(dtype_hint).lower()
    requested = _ALIASES.get(requested, requested)
    if requested == "auto":
        mode = "fp32"
        if device.type == "cuda":
            mode = "bf16" if _cuda_bf16_supported() else "fp16"
    elif requested in _DTYPES:
        mode = requested
    else:
        raise ValueError(
            f"precision.mode: unknown precision {requested!r}; expected auto, bf16, fp16 or fp32"
        )
    if device.type == "cuda" and mode == "bf16" and not _cuda_bf16_supported():
        mode = "fp32"
    if device.type == "mps" or (device.type == "cpu" and mode == "fp16"):
        mode = "fp32"
    return PrecisionPlan(
        mode=mode,
        dtype=_DTYPES[mode],
        use_scaler=(mode == "fp16" and device.type == "cuda"),
        autocast_enabled=mode in {"bf16", "fp16"},
        device_type=device.type,
    )


def autocast_context(
    plan: PrecisionPlan, device: torch.device | str | None = None
) -> contextlib.AbstractContextManager[object]:
    """The autocast context for one forward pass (a no-op context for fp32)."""
    if not plan.autocast_enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=plan.device_type, dtype=plan.dtype)


def make_grad_scaler(plan: PrecisionPlan) -> torch.amp.GradScaler | None:
    """A dynamic loss scaler for CUDA fp16 (``None`` otherwise).

    PyTorch defaults apply: initial scale 65536, x2 growth every 2000 clean steps, x0.5 backoff.
    """
    if not plan.use_scaler:
        return None
    return torch.amp.GradScaler(plan.device_type)


def parameter_count(model: nn.Module) -> int:
    """Number of parameters of ``model`` (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
