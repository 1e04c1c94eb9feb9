"""Field coercion: turn YAML/env/Python values into the declared field type or raise.

Every section ``__post_init__`` runs its fields through these helpers before any range check,
so a wrong type is always a :class:`ConfigError` naming the field and the expected type (never
a raw ``TypeError`` from a comparison). Accepted conversions:

* integers: ``int`` (not ``bool``), integral floats (``4.0``), and decimal strings (``"7"``);
* numbers: ``int``/``float`` (not ``bool``) and numeric strings such as ``"3e-4"`` (PyYAML
  reads exponent floats without a decimal point as strings); the result is a finite ``float``;
* booleans: ``bool``, the integers 0/1, and the strings true/false/yes/no/on/off/1/0
  (case-insensitive);
* strings: ``str``, and ``int``/``float`` scalars (``name: 2024``) which are converted;
  paths (:func:`to_path`) are strings the OS can take (no NUL, bounded lengths).

Integers are bounded to 64 bits here (each field's own range comes after). ``None`` is
accepted only where the field is nullable. Error messages never show a value that came from
a secret (:class:`~speedtronic.config.redaction.SecretText`) or looks like a token, and never
render more than a short prefix of a value (an alias bomb is never expanded into text).
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

from speedtronic.config.errors import ConfigError
from speedtronic.config.limits import check_path_text
from speedtronic.config.redaction import REDACTED, contains_secret, looks_like_token

__all__ = [
    "FALSE_STRINGS",
    "REDACTED",
    "TRUE_STRINGS",
    "describe",
    "to_bool",
    "to_float",
    "to_int",
    "to_path",
    "to_str",
    "to_str_list",
]

TRUE_STRINGS = frozenset({"true", "yes", "on", "1"})
FALSE_STRINGS = frozenset({"false", "no", "off", "0"})
BOOL_EXPECTED = "a boolean (true/false/yes/no/on/off/1/0)"
INT64 = 2**63
_MAX_INT_TEXT = 40  # characters of an integer written as text (int64 needs 20)

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 4, 60, 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 8
_SHORT.maxlong = 40


def describe(value: Any, *, secret: bool = False) -> str:
    """Short description of a rejected value for an error message.

    Secrets (``secret=True``, values from a secret source, token-shaped strings) show only
    their type. Others are rendered with bounded depth and length (``reprlib``), so a huge or
    self-referencing value costs no more than a short prefix.
    """
    if value is None:
        return "null"
    kind = type(value).__name__
    if isinstance(value, str):
        kind = "str"
    if secret or contains_secret(value):
        return f"{kind} {REDACTED}" if not secret else kind
    try:
        text = _SHORT.repr(value)
    except Exception:  # a hostile __repr__, an int beyond the conversion limit
        text = "<unprintable>"
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind} {text}"


def _fail(field: str, expected: str, value: Any, secret: bool = False) -> ConfigError:
    return ConfigError(f"{field} must be {expected}, got {describe(value, secret=secret)}")


def to_int(value: Any, field: str, *, nullable: bool = False) -> int | None:
    """Coerce ``value`` to ``int`` (or ``None`` when nullable)."""
    if value is None:
        if nullable:
            return None
        raise _fail(field, "an integer", value)
    if isinstance(value, bool):
        raise _fail(field, "an integer", value)
    result: int | None = None
    integral = isinstance(value, float) and math.isfinite(value) and value.is_integer()
    if isinstance(value, int) or integral:
        result = int(value)
    elif isinstance(value, str) and len(value.strip()) <= _MAX_INT_TEXT:
        text = value.strip()
        try:
            result = int(text, 10)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                number = math.nan
            if math.isfinite(number) and number.is_integer():
                result = int(number)
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        raise ConfigError(f"{field} must be a 64-bit integer, got a {len(value.strip())}-digit one")
    if result is None:
        raise _fail(field, "an integer", value)
    if not -INT64 <= result < INT64:
        raise ConfigError(f"{field} must be a 64-bit integer, got a larger one")
    return result


def to_float(value: Any, field: str, *, nullable: bool = False) -> float | None:
    """Coerce ``value`` to a finite ``float`` (or ``None`` when nullable)."""
    if value is None:
        if nullable:
            return None
        raise _fail(field, "a number", value)
    if isinstance(value, bool):
        raise _fail(field, "a number", value)
    number: float | None = None
    try:
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            number = float(value.strip())
    except (ValueError, OverflowError):
        number = None
    if number is None:
        raise _fail(field, "a number", value)
    if not math.isfinite(number):
        raise _fail(field, "a finite number", value)
    return number


def to_bool(
    value: Any, field: str, *, nullable: bool = False, message: str | None = None
) -> bool | None:
    """Coerce ``value`` to ``bool``; ``message`` prefixes the error (2.0.0 texts)."""
    if value is None and nullable:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in TRUE_STRINGS:
            return True
        if text in FALSE_STRINGS:
            return False
    error = _fail(field, BOOL_EXPECTED, value)
    if message:
        raise ConfigError(f"{message}: {error}")
    raise error


def to_str(value: Any, field: str, *, nullable: bool = False, secret: bool = False) -> str | None:
    """Coerce a scalar to ``str`` (numbers are converted; bools, lists, mappings rejected)."""
    if value is None:
        if nullable:
            return None
        raise _fail(field, "a string", value, secret)
    if isinstance(value, str):
        if not secret and looks_like_token(value):
            raise ConfigError(
                f"{field} holds what looks like a Hub access token (not shown); the token goes "
                "in HF_TOKEN or the hf_token secret file"
            )
        return str(value)  # a plain str, also for SecretText
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) >= 10**_MAX_INT_TEXT:
            raise ConfigError(f"{field} must be a string, got a {value.bit_length()}-bit integer")
        return str(value)
    if isinstance(value, float):
        return str(value)
    raise _fail(field, "a string", value, secret)


def to_path(value: Any, field: str, *, nullable: bool = False) -> str | None:
    """A string the OS can use as a path: no NUL byte, at most 4096 bytes, segments <= 255."""
    return check_path_text(to_str(value, field, nullable=nullable), field)


def to_str_list(value: Any, field: str, message: str) -> list[str]:
    """A list of non-blank strings; anything else raises ``message`` plus the detail."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ConfigError(f"{message}, got {describe(value)}")
    result = []
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(f"{message}, got item {describe(item)}")
        result.append(str(item))
    return result
