"""Reading configuration text and files into plain mappings (no validation, no environment).

``read_source`` implements the 2.0.0 ``SpeedtronicConfig.load`` heuristic (reference/config.md
§2.3): a mapping is used as is; a ``str`` that contains a newline, starts with ``{``/``[``, or
contains ``:`` and is not an existing path is inline YAML/JSON; anything else is a path
(``.yaml``/``.yml`` -> YAML, any other suffix -> JSON). Differences from 2.0.0: malformed
YAML/JSON is a :class:`ConfigError` with line and column, a missing file is a
:class:`ConfigFileNotFoundError` (also a ``FileNotFoundError``), and a token found in a file or
inline text is logged as a warning on the ``speedtronic.config`` logger.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from speedtronic.config.coercion import REDACTED
from speedtronic.config.errors import ConfigError, ConfigFileNotFoundError

__all__ = ["looks_inline", "parse_text", "read_config_file", "read_source", "warn_if_token"]

logger = logging.getLogger("speedtronic.config")


def _root_mapping(parsed: Any) -> dict[str, Any]:
    if not parsed:
        return {}
    if not isinstance(parsed, Mapping):
        raise ConfigError("configuration root must be a mapping")
    return dict(parsed)


def parse_text(text: str, *, origin: str = "<inline>", use_json: bool = False) -> dict[str, Any]:
    """Parse YAML (or JSON) text into the root mapping; syntax errors name line and column."""
    if use_json:
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{origin}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
            ) from None
        return _root_mapping(parsed)
    try:
        parsed = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "syntax error"
        raise ConfigError(f"{origin}: invalid YAML{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin}: invalid YAML: {exc}") from None
    return _root_mapping(parsed)


def warn_if_token(values: Mapping[str, Any], origin: str) -> None:
    """Log a warning when a mapping read from a file carries a Hub token (value never logged)."""
    for key in ("distributed", "hub", "diloco"):
        section = values.get(key)
        if isinstance(section, Mapping):
            token = section.get("token")
            if token and token != REDACTED:
                logger.warning(
                    "%s sets %s.token; a token in a config file is discouraged, "
                    "use HF_TOKEN or a secret file (SPEEDTRONIC_SECRETS_DIR/hf_token)",
                    origin,
                    key,
                )
                return


def read_config_file(path: str | Path, *, force_yaml: bool = False) -> dict[str, Any]:
    """Read a config file: YAML for ``.yaml``/``.yml`` (or ``force_yaml``), else JSON."""
    file_path = Path(path)
    try:
        text = file_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigFileNotFoundError(f"config file not found: {file_path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config path is a directory, not a file: {file_path}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{file_path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {file_path}: {exc.strerror}") from None
    use_json = not force_yaml and file_path.suffix.lower() not in {".yaml", ".yml"}
    values = parse_text(text, origin=str(file_path), use_json=use_json)
    warn_if_token(values, str(file_path))
    return values


def looks_inline(source: str) -> bool:
    """The 2.0.0 inline-text heuristic for a ``str`` source."""
    if "\n" in source or source.lstrip().startswith(("{", "[")):
        return True
    if ":" in source:
        try:
            return not Path(source).exists()
        except (OSError, ValueError):
            return True
    return False


def read_source(source: Any) -> dict[str, Any]:
    """Resolve any ``SpeedtronicConfig.load`` source into a root mapping."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, str) and looks_inline(source):
        values = parse_text(source)
        warn_if_token(values, "inline configuration")
        return values
    if not isinstance(source, (str, Path)):
        raise ConfigError(
            f"configuration source must be a mapping, YAML/JSON text or a path, "
            f"got {type(source).__name__}"
        )
    return read_config_file(source)
