"""The config error and the limits several config sections share: ranges, paths, ids.

A numeric field's range is checked at validation (docs/configuration.md lists them); durations
in seconds stay far below ``threading.TIMEOUT_MAX``, so a sleep or wait cannot overflow.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = [
    "DAY",
    "HOUR",
    "MAX_INT_DIGITS",
    "MAX_NODE_ID",
    "MAX_PATH",
    "MAX_SEED",
    "MAX_SEGMENT",
    "MAX_STEPS",
    "WEEK",
    "ConfigError",
    "ConfigFileNotFoundError",
    "check_node_id",
    "is_valid_node_id",
    "path_kind_problem",
]

MAX_STEPS = 10**12 - 1  # step_<12 digits>.pt
MAX_SEED = 2**32 - 1  # numpy.random.seed's limit; torch.manual_seed accepts more
MAX_PATH = 4096  # PATH_MAX on Linux
MAX_SEGMENT = 255  # NAME_MAX on Linux
HOUR, DAY, WEEK = 3600.0, 86400.0, 604800.0  # seconds, far below threading.TIMEOUT_MAX
MAX_INT_DIGITS = 40  # longer integer text is refused, not converted (int64 needs 20 digits)
MAX_NODE_ID = 128  # one path segment, with room for the files named after it
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]*")


class ConfigError(ValueError):
    """A configuration problem; the message names the field (or file) and the fix."""


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """The configuration file does not exist (also a ``FileNotFoundError`` for 2.0.0 callers)."""


def path_kind_problem(path: str | os.PathLike[str], want: str) -> str | None:
    """Why ``path`` cannot be used as a ``file``, a ``dir`` or ``tokens`` (a token file or a
    folder written by ``speedtronic prepare``); ``None`` when it can or may.

    Only what exists is judged: the path itself (a directory where a file is wanted, or the
    reverse) and its nearest existing ancestor (which must be a directory). A path that does
    not exist yet is fine; permissions are left to the run (a config is often validated on
    another machine than the one that runs it).
    """
    target = Path(path)
    try:
        if target.exists():
            if want == "file" and target.is_dir():
                return "is a directory, expected a file"
            if want == "dir" and not target.is_dir():
                return "is a file, expected a directory"
            if want == "tokens" and target.is_dir() and not (target / "meta.json").is_file():
                return (
                    "is a directory, expected a token file or a folder written by "
                    "speedtronic prepare (it has no meta.json)"
                )
            return None
        for parent in target.parents:
            if parent.exists():
                return None if parent.is_dir() else f"{parent} is a file, not a directory"
    except OSError as exc:  # e.g. a parent that is a file (ENOTDIR), a loop
        return exc.strerror or str(exc)
    return None


#: A Hub repository id as the Hub accepts one, with its owner: two parts of letters, digits,
#: ``-``, ``_`` and ``.`` (a name of at most 96), neither starting nor ending with ``-`` or
#: ``.``, no ``--`` or ``..``, not ending in ``.git`` (huggingface_hub's ``validate_repo_id``).
_HUB_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_HUB_REPO_ID = re.compile(rf"{_HUB_PART}/(?=.{{1,96}}$){_HUB_PART}")


def is_hub_repo_id(value: str) -> bool:
    """``owner/name`` as the Hub accepts a repo id (the one rule: exchange, push, datasets)."""
    return (
        isinstance(value, str)
        and bool(_HUB_REPO_ID.fullmatch(value))
        and not ("--" in value or ".." in value or value.endswith(".git"))
    )


def is_valid_node_id(value: str) -> bool:
    """The node-id rule: path-safe characters, at most ``MAX_NODE_ID`` characters."""
    return isinstance(value, str) and len(value) <= MAX_NODE_ID and bool(_NODE_ID.fullmatch(value))


def check_node_id(value: str, field: str = "distributed.node_id") -> str:
    """``value`` stripped when it is a valid node id, else a ``ConfigError`` naming the rule."""
    text = str(value).strip()
    if is_valid_node_id(text):
        return text
    if len(text) > MAX_NODE_ID:
        detail = f"it has {len(text)} characters, at most {MAX_NODE_ID} are allowed"
    else:
        detail = "use letters, digits and . _ - @ +, starting with a letter or digit"
    raise ConfigError(
        f"{field} must be a non-empty path-safe identifier ({detail}; set distributed.node_id "
        "or SPEEDTRONIC_NODE_ID)"
    )
