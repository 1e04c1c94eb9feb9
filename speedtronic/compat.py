"""The 2.0.0 import paths, from one alias table.

Speedtronic 2.0.0 had flat modules (``speedtronic.runtime``, ``speedtronic.trainer``, ...) and
a ``speedtronic.distributed`` package. Their code now lives in ``speedtronic.train``,
``speedtronic.optim``, ``speedtronic.model``, ``speedtronic.metrics`` and
``speedtronic.diloco``. Code written for 2.0.0 keeps importing the old paths: each is a module
file of three lines (``speedtronic/runtime.py``, ``speedtronic/distributed/hub.py``, ...) that
calls `deprecated_module`, and everything else about it is its row in `ALIASES`. Its
attributes *are* the objects of the real modules (no copies, no wrappers), fetched on first
access. Importing an old path issues one ``DeprecationWarning`` naming the new path; nothing
is imported until an old path is asked for, and ``import speedtronic`` neither imports this
module nor changes the import machinery (no finder, no hook).

An alias module's ``__all__`` is the 2.0.0 export list. A name outside it resolves from the
target modules too (2.0.0 code also reached non-exported helpers), except in the
``speedtronic.distributed`` package, where other names are its submodules.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

__all__ = ["ALIASES", "Alias", "SyncResult", "deprecated_module"]


@dataclass(frozen=True)
class Alias:
    """One 2.0.0 module path: where its names live now and what it exported.

    ``targets`` are searched in order for each name; ``exports`` is the 2.0.0 ``__all__``;
    ``extras`` are importable names not in ``__all__``; ``package`` marks an old package
    (its submodules are aliases too, and unknown names are not looked up in the targets).
    """

    targets: tuple[str, ...]
    exports: tuple[str, ...]
    extras: tuple[str, ...] = ()
    package: bool = False
    names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", frozenset(self.exports) | frozenset(self.extras))


@dataclass
class SyncResult:
    """2.0.0's ``speedtronic.distributed.SyncResult``: exported by 2.0.0 but never produced by
    anything there or here; kept importable for code that names it, nowhere else."""

    pushed: bool = False
    loaded_global: bool = False
    outer_step: int = 0


#: old module path -> `Alias` (the 2.0.0 surfaces of reference/engine.md, distributed.md, v2.md).
ALIASES: dict[str, Alias] = {
    "speedtronic.runtime": Alias(
        ("speedtronic.train.runtime",),
        (
            "build_logger",
            "build_optimizer",
            "build_runtime",
            "build_scheduler",
            "run",
            "seed_everything",
            "train",
            "train_from_config",
        ),
    ),
    "speedtronic.trainer": Alias(
        ("speedtronic.train.trainer",),
        (
            "GradientOverflowError",
            "NonFiniteLossError",
            "SpeedtronicTrainer",
            "SyncCoordinator",
            "TrainResult",
            "Trainer",
            "TrainingEngine",
        ),
    ),
    "speedtronic.precision": Alias(
        ("speedtronic.train.precision", "speedtronic.optim"),
        (
            "PrecisionPlan",
            "autocast_context",
            "make_grad_scaler",
            "resolve_device",
            "resolve_precision",
            "supports_fused_adamw",
        ),
        extras=("parameter_count",),
    ),
    "speedtronic.shapes": Alias(
        ("speedtronic.train.shapes",),
        (
            "ShapeProfile",
            "ShapeReport",
            "ShapeWarning",
            "resolve_shape_profile",
            "validate_startup_shapes",
        ),
    ),
    "speedtronic.scheduling": Alias(
        ("speedtronic.train.ooo",), ("StageInfo", "StageStreamScheduler")
    ),
    "speedtronic.optimizers": Alias(
        ("speedtronic.optim",),
        (
            "CautiousOptimizer",
            "HybridOptimizer",
            "Muon",
            "ParameterRouting",
            "build_v2_optimizer",
            "newton_schulz",
            "post_polar_normalize",
            "route_parameters",
        ),
    ),
    "speedtronic.registry": Alias(
        ("speedtronic.model.registry",),
        ("ModelFactory", "ModelRegistry", "build_model", "register_model", "registry"),
    ),
    "speedtronic.profiling": Alias(
        ("speedtronic.metrics.hooks", "speedtronic.metrics.logger"),
        ("CallbackList", "MetricLogger", "TrainingHook", "memory_usage_bytes"),
    ),
    "speedtronic.hooks": Alias(
        ("speedtronic.metrics.hooks",), ("CallbackList", "TrainingHook", "on_event")
    ),
    "speedtronic.integrations": Alias(
        ("speedtronic.metrics.integrations",), ("TensorboardHook", "WandbHook")
    ),
    "speedtronic.distributed": Alias(
        ("speedtronic.diloco", "speedtronic.compat"),
        (
            "DumbDiLoCo",
            "DumbDiLoCoCoordinator",
            "GlobalMetadata",
            "HubClient",
            "HubError",
            "HubTransport",
            "HubUnavailable",
            "MasterOuterLoop",
            "NesterovOuterOptimizer",
            "SyncResult",
            "average_deltas",
            "compute_pseudo_gradient",
            "load_delta",
            "load_safetensors",
            "save_safetensors",
        ),
        extras=("DeltaUploadJob",),
        package=True,
    ),
    "speedtronic.distributed.diloco": Alias(
        (
            "speedtronic.diloco.coordinator",
            "speedtronic.diloco",
            "speedtronic.diloco.node",
            "speedtronic.compat",
        ),
        ("DeltaUploadJob", "DumbDiLoCo", "DumbDiLoCoCoordinator", "GlobalCandidate", "SyncResult"),
    ),
    "speedtronic.distributed.hub": Alias(
        # exchange.py's wire format and codecs moved to codec.py, its errors and retry policy
        # to speedtronic.retry: 2.0.0 code that reached a helper through this path finds it
        (
            "speedtronic.diloco.hub",
            "speedtronic.diloco.exchange",
            "speedtronic.retry",
            "speedtronic.diloco.codec",
        ),
        ("GlobalMetadata", "HubClient", "HubError", "HubTransport", "HubUnavailable"),
    ),
    "speedtronic.distributed.outer": Alias(
        ("speedtronic.diloco.master", "speedtronic.diloco"),
        ("MasterOuterLoop", "NesterovOuterOptimizer"),
    ),
    "speedtronic.distributed.tensors": Alias(
        ("speedtronic.diloco.codec", "speedtronic.diloco.exchange"),
        (
            "average_deltas",
            "compute_pseudo_gradient",
            "load_delta",
            "load_safetensors",
            "parse_delta_path",
            "save_safetensors",
        ),
    ),
}


def new_path(old: str) -> str:
    """The module (or modules) that now hold the names of the 2.0.0 module `old`."""
    return " / ".join(ALIASES[old].targets)


def _lookup(old: str, alias: Alias, name: str) -> Any:
    """``name`` from the first target module that has it; AttributeError otherwise."""
    if alias.package and name not in alias.names:
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    for target in alias.targets:
        module = importlib.import_module(target)
        try:
            return getattr(module, name)
        except AttributeError:
            continue
    raise AttributeError(
        f"module {old!r} has no attribute {name!r} (2.0.0 path of {new_path(old)})"
    )


def _caller_stacklevel() -> int:
    """The ``warnings`` stack level of the code that imported the old path.

    ``warnings`` already skips the frozen ``importlib._bootstrap`` frames without counting
    them; the frames of this module, of the 2.0.0 module files and of
    ``importlib.import_module`` are counted and skipped here.
    """
    frame: FrameType | None = sys._getframe(1)  # deprecated_module, which warns
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back
            continue
        outside = (
            name != __file__
            and frame.f_globals.get("__name__") not in ALIASES
            and not name.endswith(("importlib/__init__.py", "importlib\\__init__.py"))
        )
        if outside:
            break
        frame = frame.f_back
        level += 1
    return level


def deprecated_module(
    old: str,
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """Warn once that the 2.0.0 module ``old`` is deprecated; its ``__all__``, ``__getattr__``
    and ``__dir__``.

    Called by the module files at the 2.0.0 paths while they run (``old`` is their
    ``__name__``); a name is fetched from the real modules on first access and kept in the
    old module's namespace, so the old path hands out the very same objects.
    """
    alias = ALIASES[old]
    module = sys.modules[old]
    warnings.warn(
        f"{old} is a deprecated 2.0.0 import path; import from {new_path(old)} instead",
        DeprecationWarning,
        stacklevel=_caller_stacklevel(),
    )

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _lookup(old, alias, name)
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | alias.names)

    return list(alias.exports), __getattr__, __dir__
