"""Startup shape validation: advisory warnings for tensor-core unfriendly sizes.

On CUDA with bf16/fp16, GEMMs run fastest when their dimensions are multiples of 8. At startup
the runtime calls :func:`validate_startup_shapes` once; it never raises for unaligned shapes and
never changes the config or the model. Warnings go to ``logger.warning`` (one line each) and, when
the logger has ``emit``, to events ``shape_warning`` (per warning) and ``shape_profile``.

Alignment (``shape_validation.alignment``): ``auto`` = 8 on CUDA with resolved bf16/fp16,
otherwise off; ``none`` = off everywhere; an integer = that alignment on any device. On CPU/MPS
checks run only with ``warn_on_cpu: true``.

Codes: ``batch_alignment`` (``data.micro_batch_size``; the suggestion is a multiple of the
alignment that divides ``data.target_batch_size``, else ``None``), ``sequence_alignment``
(``data.block_size``), ``token_alignment`` (micro batch × block size), ``model_alignment``
(Linear/Embedding/Conv2d widths, or the model's ``speedtronic_shape_metadata()`` mapping) and
``vocab_alignment`` (``model.vocab_size``, only with ``check_vocab``; a Linear whose output width
is the vocabulary, i.e. the LM head, is counted as vocabulary, not as a model width). Equal
unaligned values of one code are reported once, naming the first field and the repeat count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from speedtronic.config import SpeedtronicConfig
from speedtronic.json_types import JSON
from speedtronic.metrics.logger import EventLog, TextLog

if TYPE_CHECKING:
    from speedtronic.train.precision import PrecisionPlan

__all__ = [
    "ShapeProfile",
    "ShapeReport",
    "ShapeWarning",
    "resolve_shape_profile",
    "validate_startup_shapes",
]

MIXED_PRECISION_ALIGNMENT = 8

REASONS = {
    "batch_alignment": "micro batch size affects GEMM efficiency under mixed precision",
    "sequence_alignment": "sequence length affects attention and GEMM tile utilisation",
    "token_alignment": "tokens per micro batch (batch × sequence) form the GEMM row count",
    "model_alignment": "projection widths off a multiple of the alignment underuse tensor cores",
    "vocab_alignment": "vocabulary size sets the output projection width",
}


@dataclass(frozen=True)
class ShapeProfile:
    """Resolved alignment: ``alignment`` None means no checks; ``source`` explains why."""

    device_type: str
    precision: str
    alignment: int | None
    source: str  # "explicit" | "disabled" | "device-default" | "cuda-mixed-precision"


@dataclass(frozen=True)
class ShapeWarning:
    """One unaligned size: ``value`` is not a multiple of ``alignment``."""

    code: str
    field: str
    value: int
    suggested: int | None
    alignment: int
    reason: str


@dataclass(frozen=True)
class ShapeReport:
    """The result of :func:`validate_startup_shapes`."""

    profile: ShapeProfile
    warnings: tuple[ShapeWarning, ...] = field(default_factory=tuple)

    @property
    def warning_count(self) -> int:
        """Number of warnings."""
        return len(self.warnings)

    def codes(self) -> set[str]:
        """The distinct warning codes."""
        return {w.code for w in self.warnings}

    def as_dict(self) -> JSON:
        """``{"profile": {...}, "warning_count": n, "warnings": [{...}, ...]}`` (JSON-ready)."""
        return {
            "profile": asdict(self.profile),
            "warning_count": self.warning_count,
            "warnings": [asdict(w) for w in self.warnings],
        }


def _precision_mode(precision: PrecisionPlan | str) -> str:
    """``PrecisionPlan.mode`` (a plain string is accepted too)."""
    mode = precision if isinstance(precision, str) else precision.mode
    return str(mode).lower()


def resolve_shape_profile(
    device: torch.device | str,
    precision: PrecisionPlan | str,
    *,
    requested_alignment: int | str | None = "auto",
) -> ShapeProfile:
    """Which alignment applies to ``device`` with resolved ``precision``.

    ``None``/``"auto"`` -> 8 on CUDA with bf16/fp16, else None; ``"none"`` -> None everywhere;
    a positive int (or integer string) -> that value. Raises ``ValueError`` otherwise.
    """
    device = torch.device(device)
    mode = _precision_mode(precision)
    requested = "auto" if requested_alignment is None else requested_alignment
    if isinstance(requested, str) and requested.strip().lower() in ("auto", "none"):
        if requested.strip().lower() == "none":
            return ShapeProfile(device.type, mode, None, "disabled")
        if device.type == "cuda" and mode in ("bf16", "fp16"):
            return ShapeProfile(
                device.type, mode, MIXED_PRECISION_ALIGNMENT, "cuda-mixed-precision"
            )
        return ShapeProfile(device.type, mode, None, "device-default")
    if isinstance(requested, bool):
        raise ValueError("shape alignment must be 'auto', 'none' or a positive integer")
    try:
        value = int(requested)
    except (TypeError, ValueError) as exc:
        raise ValueError("shape alignment must be 'auto', 'none' or a positive integer") from exc
    if value <= 0:
        raise ValueError("shape alignment must be positive")
    return ShapeProfile(device.type, mode, value, "explicit")


def _suggest(value: int, alignment: int) -> int:
    return math.ceil(value / alignment) * alignment


def _suggest_batch(micro: int, target: int, alignment: int) -> int | None:
    """Multiple of ``alignment`` dividing ``target`` closest to ``micro`` (ties: larger)."""
    if target <= 0:
        return _suggest(micro, alignment)
    candidates = [c for c in range(alignment, target + 1, alignment) if target % c == 0]
    if not candidates:
        return None
    return min(candidates, key=lambda c: (abs(c - micro), -c))


def _model_dimensions(model: nn.Module, vocab: int | None) -> list[tuple[str, int, str]]:
    """``(field, value, code)`` for the model's widths (metadata hook, else introspection)."""
    hook = getattr(model, "speedtronic_shape_metadata", None)
    if callable(hook):
        try:
            metadata = hook()
        except Exception:  # a broken user hook must not stop training; introspect instead
            metadata = None
        if isinstance(metadata, Mapping):
            try:
                return [(str(k), int(v), "model_alignment") for k, v in metadata.items()]
            except (TypeError, ValueError):
                pass
    entries: list[tuple[str, int, str]] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, nn.Linear):
            entries.append((f"{name}.in_features", module.in_features, "model_alignment"))
            code = "vocab_alignment" if module.out_features == vocab else "model_alignment"
            entries.append((f"{name}.out_features", module.out_features, code))
        elif isinstance(module, nn.Embedding):
            entries.append((f"{name}.embedding_dim", module.embedding_dim, "model_alignment"))
        elif isinstance(module, nn.Conv2d):
            entries.append((f"{name}.in_channels", module.in_channels, "model_alignment"))
            entries.append((f"{name}.out_channels", module.out_channels, "model_alignment"))
    return entries


def _candidates(config: SpeedtronicConfig, model: nn.Module) -> list[tuple[str, str, int]]:
    """``(code, field, value)`` in check order, filtered by the ``check_*`` flags."""
    section, data = config.shape_validation, config.data
    micro, block = data.micro_batch_size, data.block_size or 0
    vocab = config.model.vocab_size
    items: list[tuple[str, str, int]] = []
    if section.check_batch:
        items.append(("batch_alignment", "data.micro_batch_size", micro))
    if section.check_sequence:
        items.append(("sequence_alignment", "data.block_size", block))
        items.append(("token_alignment", "data.micro_batch_size * data.block_size", micro * block))
    dims = _model_dimensions(model, vocab)
    if section.check_model:
        items += [(code, name, v) for name, v, code in dims if code == "model_alignment"]
    if section.check_vocab:
        items.append(("vocab_alignment", "model.vocab_size", vocab))
        items += [(code, name, v) for name, v, code in dims if code == "vocab_alignment"]
    return items


def _collect_warnings(
    config: SpeedtronicConfig, model: nn.Module, alignment: int
) -> list[ShapeWarning]:
    target = config.data.target_batch_size
    first: dict[tuple[str, int], tuple[str, str, int]] = {}
    repeats: dict[tuple[str, int], int] = {}
    for code, name, value in _candidates(config, model):
        if value <= 0 or value % alignment == 0:
            continue
        key = (code, value)
        if key in first:
            repeats[key] += 1
            continue
        first[key], repeats[key] = (code, name, value), 0
    warnings = []
    for key, (code, name, value) in first.items():
        if code == "batch_alignment":
            suggested = _suggest_batch(value, target, alignment)
        else:
            suggested = _suggest(value, alignment)
        reason = REASONS[code]
        if repeats[key]:
            reason += f" (also {repeats[key]} other field(s) with this value)"
        warnings.append(ShapeWarning(code, name, value, suggested, alignment, reason))
    return warnings


def validate_startup_shapes(
    config: SpeedtronicConfig,
    model: nn.Module,
    device: torch.device | str,
    precision: PrecisionPlan | str,
    *,
    logger: EventLog | TextLog | None = None,
) -> ShapeReport:
    """Check configured and model sizes against the alignment; advisory only (see module doc).

    ``precision`` is a ``PrecisionPlan`` (its ``mode`` is read) or a mode string. ``logger`` may
    be a ``MetricLogger`` (``warning`` + ``emit``) or a ``logging.Logger`` (``warning`` only).
    The report is empty when validation is disabled, the alignment is off, or the device is CPU/MPS
    without ``warn_on_cpu``; ``shape_profile`` is emitted whenever a logger can take events.
    """
    section = config.shape_validation
    device = torch.device(device)
    profile = resolve_shape_profile(device, precision, requested_alignment=section.alignment)
    cpu_like = device.type in ("cpu", "mps")
    warnings: list[ShapeWarning] = []
    if section.enabled and profile.alignment is not None and (not cpu_like or section.warn_on_cpu):
        warnings = _collect_warnings(config, model, profile.alignment)
    report = ShapeReport(profile, tuple(warnings))
    _log_report(report, logger)
    return report


def _log_report(report: ShapeReport, logger: EventLog | TextLog | None) -> None:
    if logger is None:
        return
    emit = logger.emit if isinstance(logger, EventLog) else None
    for item in report.warnings:
        logger.warning(
            "shape warning: %s=%s is not a multiple of %s; consider %s (%s)",
            item.field,
            item.value,
            item.alignment,
            "null" if item.suggested is None else item.suggested,
            item.reason,
        )
        if emit is not None:
            emit("shape_warning", asdict(item))
    if emit is not None:
        emit(
            "shape_profile",
            {
                "device_type": report.profile.device_type,
                "precision": report.profile.precision,
                "alignment": report.profile.alignment,
                "warning_count": report.warning_count,
            },
        )
