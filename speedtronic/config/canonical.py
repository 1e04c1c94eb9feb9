"""Alias and shorthand handling: turn any accepted mapping into the canonical nested form.

The canonical form has only section keys (``run``, ``model``, ...) whose values are plain dicts
(or ``None``/section instances passed through), plus the four root scalars. It is what the
layering merges (each layer is canonicalised first, so ``max_steps: 4`` in a file and
``SPEEDTRONIC_RUN__MAX_STEPS`` in the environment address the same field) and what
``SpeedtronicConfig.from_dict`` builds from. Order follows reference/config.md §4.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from speedtronic.config.errors import ConfigError

__all__ = [
    "ROOT_ALIASES",
    "ROOT_FIELDS",
    "RUN_ALIASES",
    "SECTION_NAMES",
    "canonicalize",
    "unknown_keys_message",
]

SECTION_NAMES = (
    "run",
    "model",
    "data",
    "optimizer",
    "scheduler",
    "precision",
    "checkpoint",
    "logging",
    "distributed",
    "shape_validation",
    "metrics",
    "eval",
)
ROOT_FIELDS = ("gradient_checkpointing", "compile", "ooo_backprop", "ooo_streams")
RUN_ALIASES = ("name", "seed", "device", "output_dir", "max_steps", "log_every")
ROOT_ALIASES = (*RUN_ALIASES, "hub", "diloco", "muon_plus", "cautious")


def unknown_keys_message(keys: Any, prefix: str = "") -> str:
    """The 2.0.0 text: ``[<section>: ]unknown configuration keys: a, b`` (sorted)."""
    joined = ", ".join(sorted(str(key) for key in keys))
    return f"{prefix}unknown configuration keys: {joined}"


def _as_dict(value: Any) -> Any:
    """A section instance becomes a dict of its fields; anything else is returned unchanged."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return value


def canonicalize(values: Any) -> dict[str, Any]:
    """Apply run aliases, section aliases and optimizer/precision/compile shorthands.

    Raises ``ConfigError`` for a non-mapping root, conflicting duplicates and unknown root keys.
    Section values are not validated here (the section classes do that).
    """
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ConfigError("configuration root must be a mapping")
    data: dict[str, Any] = {str(key): value for key, value in values.items()}

    run = data.get("run")
    run = {} if run is None else _as_dict(run)
    if not isinstance(run, Mapping):
        raise ConfigError("run must be a mapping")
    run = dict(run)
    for alias in RUN_ALIASES:
        if alias in data:
            run[alias] = data.pop(alias)
    if run or "run" in data:
        data["run"] = run

    for alias in ("hub", "diloco"):
        if alias in data and "distributed" not in data:
            data["distributed"] = data.pop(alias)

    if isinstance(data.get("optimizer"), str):
        data["optimizer"] = {"name": data["optimizer"]}
    for flag in ("muon_plus", "cautious"):
        if flag not in data:
            continue
        optimizer = _as_dict(data.get("optimizer"))
        if optimizer is None:
            optimizer = {}
        if not isinstance(optimizer, Mapping):
            raise ConfigError("optimizer must be a mapping or optimizer name string")
        optimizer = dict(optimizer)
        value = data.pop(flag)
        if flag in optimizer and optimizer[flag] != value:
            raise ConfigError(f"conflicting optimizer.{flag} values")
        optimizer[flag] = value
        data["optimizer"] = optimizer

    if isinstance(data.get("precision"), str):
        data["precision"] = {"mode": data["precision"]}

    unknown = set(data) - set(SECTION_NAMES) - set(ROOT_FIELDS)
    if unknown:
        raise ConfigError(unknown_keys_message(unknown))

    compile_value = data.get("compile")
    if isinstance(compile_value, Mapping):
        extra = set(compile_value) - {"enabled"}
        if extra:
            raise ConfigError(unknown_keys_message(extra, "compile: "))
        data["compile"] = compile_value.get("enabled", False)
    return data
