"""Alias and shorthand handling: turn any accepted mapping into the canonical nested form.

The canonical form has only section keys (``run``, ``model``, ...) whose values are plain dicts
(or ``None``/section instances passed through), plus the four root scalars. It is what
``SpeedtronicConfig.from_canonical`` builds from, without normalising again. Normalisation runs
once, where a mapping enters: :func:`canonicalize` for a config file, inline text or a
``from_dict`` mapping (which may use any 2.0.0 form); the environment, secret files and
``--set`` address canonical fields by name, so only their values' shorthand
(:func:`compile_shorthand`) applies to them. The layering then merges the canonical layers, so
``max_steps: 4`` in a file and ``SPEEDTRONIC_RUN__MAX_STEPS`` address the same field. Order
follows reference/config.md §4.

Two 2.0.0 forms are normalised here too, each with a warning on the ``speedtronic.config``
logger: the retired settings of `RETIRED` (accepted only at their one legal value, then dropped)
and a log path written relative to the working directory under ``run.output_dir`` (see
`rebase_legacy_log_paths`).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Iterable, Mapping
from pathlib import PurePath

from speedtronic.config.errors import ConfigError

__all__ = [
    "LOG_PATH_FIELDS",
    "RETIRED",
    "ROOT_ALIASES",
    "ROOT_FIELDS",
    "RUN_ALIASES",
    "SECTION_NAMES",
    "as_dict",
    "canonicalize",
    "compile_shorthand",
    "rebase_legacy_log_paths",
    "unknown_keys_message",
]

logger = logging.getLogger("speedtronic.config")

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
    "runtime",
)
ROOT_FIELDS = ("gradient_checkpointing", "compile", "ooo_backprop", "ooo_streams")
RUN_ALIASES = ("name", "seed", "device", "output_dir", "max_steps", "log_every")
ROOT_ALIASES = (*RUN_ALIASES, "hub", "diloco", "muon_plus", "cautious")
#: Log paths relative to ``run.output_dir`` (2.0.0: relative to the working directory).
LOG_PATH_FIELDS = ("file", "json_file")


def _queue_size_is_one(value: object) -> bool:
    if isinstance(value, str):
        return value.strip() == "1"
    return isinstance(value, (bool, int, float)) and value == 1


def _overflow_is_skip(value: object) -> bool:
    return isinstance(value, str) and value.strip().lower() == "skip"


#: 2.0.0 settings that had one legal value and are gone: (section, key) -> (is the legal value,
#: the 2.0.0 error for any other value). A file that sets the legal value still loads.
RETIRED = {
    ("distributed", "delta_upload_queue_size"): (
        _queue_size_is_one,
        "distributed.delta_upload_queue_size must be 1 in v2",
    ),
    ("distributed", "delta_upload_overflow"): (
        _overflow_is_skip,
        "distributed.delta_upload_overflow must be 'skip'",
    ),
}


def unknown_keys_message(
    keys: Iterable[object], prefix: str = "", known: Iterable[str] = ()
) -> str:
    """The 2.0.0 text ``[<section>: ]unknown configuration keys: a, b`` (sorted), plus the
    nearest known name of the first key that resembles one (``did you mean max_steps?``)."""
    names = sorted(str(key) for key in keys)
    message = f"{prefix}unknown configuration keys: {', '.join(names)}"
    choices = sorted(str(name) for name in known if name not in names)
    for name in names:
        close = difflib.get_close_matches(name, choices, n=1, cutoff=0.75)
        if close:
            return f"{message} (did you mean {close[0]}?)"
    return message


def as_dict(value: object) -> object:
    """A section instance becomes a dict of its fields; anything else is returned unchanged."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return value


def canonicalize(values: object) -> dict[str, object]:
    """Apply run aliases, section aliases and optimizer/precision/compile shorthands.

    Raises ``ConfigError`` for a non-mapping root, conflicting duplicates and unknown root keys.
    Section values are not validated here (the section classes do that).
    """
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ConfigError("configuration root must be a mapping")
    data: dict[str, object] = {str(key): value for key, value in values.items()}

    run = data.get("run")
    run = {} if run is None else as_dict(run)
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
        optimizer = as_dict(data.get("optimizer"))
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
        raise ConfigError(unknown_keys_message(unknown, "", (*SECTION_NAMES, *ROOT_ALIASES)))

    if "compile" in data:
        data["compile"] = compile_shorthand(data["compile"])
    _drop_retired(data)
    rebase_legacy_log_paths(data)
    return data


def compile_shorthand(value: object) -> object:
    """The 2.0.0 ``compile: {enabled: x}`` form -> ``x`` (``{}`` -> False); other values as is.

    Any key besides ``enabled`` is a ``ConfigError`` (``compile: unknown configuration keys``).
    """
    if not isinstance(value, Mapping):
        return value
    extra = set(value) - {"enabled"}
    if extra:
        raise ConfigError(unknown_keys_message(extra, "compile: "))
    return value.get("enabled", False)


def _drop_retired(data: dict[str, object]) -> None:
    """Remove the `RETIRED` keys: their one legal value is dropped with a warning, any other
    value is the 2.0.0 ``ConfigError``."""
    for (section, key), (is_legal, message) in RETIRED.items():
        values = data.get(section)
        if not isinstance(values, Mapping) or key not in values:
            continue
        if not is_legal(values[key]):
            raise ConfigError(message)
        data[section] = {name: item for name, item in values.items() if name != key}
        logger.warning(
            "%s.%s is retired (its one legal value is how Speedtronic works); the setting is "
            "ignored, remove it from the config",
            section,
            key,
        )


def rebase_legacy_log_paths(data: dict[str, object]) -> None:
    """Read a 2.0.0-style log path as the path below ``run.output_dir`` it names.

    ``logging.file`` and ``logging.json_file`` are relative to ``run.output_dir`` now; 2.0.0
    took them relative to the working directory, so its configs spell the output directory out
    (``json_file: runs/smoke/events.jsonl`` beside ``output_dir: runs/smoke``). Such a path (a
    relative path that starts with the mapping's own relative ``run.output_dir``, or with the
    default ``runs`` when the mapping sets none) becomes the rest of the path
    (``events.jsonl``): the same file as in 2.0.0, which now also follows ``--output-dir``. A
    warning names the field and the new spelling. Absolute paths are never changed.
    """
    section = data.get("logging")
    if not isinstance(section, Mapping):
        return
    run = data.get("run")
    output_dir = run.get("output_dir") if isinstance(run, Mapping) else None
    if output_dir is None:
        from speedtronic.config.sections import RunConfig

        output_dir = RunConfig().output_dir
    if not isinstance(output_dir, str) or PurePath(output_dir).is_absolute():
        return
    prefix = PurePath(output_dir).parts
    rebased = dict(section)
    for key in LOG_PATH_FIELDS:
        value = section.get(key)
        if not isinstance(value, str) or not prefix:
            continue
        parts = PurePath(value).parts
        if PurePath(value).is_absolute() or len(parts) <= len(prefix):
            continue
        if parts[: len(prefix)] != prefix:
            continue
        rebased[key] = str(PurePath(*parts[len(prefix) :]))
        logger.warning(
            "logging.%s: %s is read as %s below run.output_dir (log paths are relative to "
            "run.output_dir since 2.1); write %s to keep this meaning",
            key,
            value,
            rebased[key],
            rebased[key],
        )
    data["logging"] = rebased
