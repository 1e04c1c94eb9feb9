"""The configuration error type shared by every config module."""

from __future__ import annotations

__all__ = ["ConfigError", "ConfigFileNotFoundError"]


class ConfigError(ValueError):
    """A configuration problem; the message names the field (or file) and the fix."""


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """The configuration file does not exist (also a ``FileNotFoundError`` for 2.0.0 callers)."""
