"""Keeping the Hub token out of text: every spelling of a secret, and values marked secret.

:func:`scrub` is the one scrubber (transports, coordinator, metrics and CLI use it). It replaces
every spelling :func:`secret_forms` lists, in any letter case, and anything shaped like a Hub
token. :class:`SecretText` marks a string from a secret source, so a field error never prints
it (:func:`contains_secret`); :func:`holds_secret` lets the config refuse the token in any
field but its own, so no name built from the config carries it.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from urllib.parse import quote, quote_plus

__all__ = [
    "REDACTED",
    "TOKEN_PATTERN",
    "SecretText",
    "contains_secret",
    "holds_secret",
    "looks_like_token",
    "scrub",
    "secret_forms",
    "strings",
]

REDACTED = "<redacted>"
#: Shape of a Hugging Face access token (``hf_`` + 34 letters and digits today).
TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9]{20,}")
_MIN_SECRET = 4  # shorter values would redact ordinary words
_MIN_INSIDE = 8  # a shorter secret is refused in a field only as the whole value


class SecretText(str):
    """A string that came from a secret source; never shown in an error message."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(REDACTED)


def looks_like_token(text: str) -> bool:
    """True when ``text`` contains something shaped like a Hub access token."""
    return bool(TOKEN_PATTERN.search(text))


def strings(value: object, _depth: int = 0) -> Iterator[str]:
    """The strings of ``value``: itself, or inside lists, tuples, sets and mappings (keys too),
    at most 32 levels deep (a value built in code may refer to itself)."""
    if isinstance(value, str):
        yield value
    elif _depth < 32 and isinstance(value, (Mapping, list, tuple, set, frozenset)):
        items = [*value.keys(), *value.values()] if isinstance(value, Mapping) else value
        for item in items:
            yield from strings(item, _depth + 1)


def contains_secret(value: object) -> bool:
    """True when ``value`` is, or holds, a :class:`SecretText` or a token-shaped string."""
    return any(isinstance(text, SecretText) or looks_like_token(text) for text in strings(value))


def _escapes(text: str) -> set[str]:
    """``text`` as ``repr`` and JSON write it inside quotes."""
    return {
        repr(text)[1:-1],
        json.dumps(text)[1:-1],
        json.dumps(text, ensure_ascii=False)[1:-1],
        repr(text.encode("utf-8", "backslashreplace"))[2:-1],
    }


@functools.lru_cache(maxsize=64)
def secret_forms(secret: str) -> tuple[str, ...]:
    """Every spelling of ``secret`` worth scrubbing, longest first.

    The raw value and its whitespace-stripped core, each also lowercased and case-folded
    (what a choice field makes of it); each escaped once and twice (``repr``, JSON, bytes
    ``repr``: a JSON log line of a repr'd message); percent-encoded; base64 and URL-safe
    base64 (without padding). Forms shorter than 4 characters are left out. :func:`scrub`
    matches the forms in any letter case.
    """
    cores = {secret, secret.strip()}
    cores |= {form for core in list(cores) for form in (core.lower(), core.casefold())}
    forms = set(cores)
    for _ in range(2):
        forms |= {escaped for form in list(forms) for escaped in _escapes(form)}
    for core in cores:
        raw = core.encode("utf-8", "backslashreplace")
        forms |= {quote(core, safe=""), quote_plus(core)}
        forms |= {
            base64.b64encode(raw).decode("ascii").rstrip("="),
            base64.urlsafe_b64encode(raw).decode("ascii").rstrip("="),
        }
    usable = {form for form in forms if len(form) >= _MIN_SECRET}
    return tuple(sorted(usable, key=lambda form: (-len(form), form)))


@functools.lru_cache(maxsize=64)
def _secret_pattern(secret: str) -> tuple[tuple[str, ...], re.Pattern[str]]:
    """The lowercased forms of ``secret`` (a quick test) and one case-insensitive pattern
    for all of them (longest first)."""
    forms = secret_forms(secret)
    pattern = re.compile("|".join(re.escape(form) for form in forms) or "(?!)", re.IGNORECASE)
    return tuple({form.lower() for form in forms}), pattern


def scrub(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with every form of every secret, in any letter case (and any token-shaped
    string), redacted."""
    lowered = None
    for secret in secrets:
        if secret and len(secret.strip()) >= _MIN_SECRET:
            forms, pattern = _secret_pattern(str(secret))
            lowered = text.lower() if lowered is None else lowered
            if any(form in lowered for form in forms):  # the pattern only where it may match
                text = pattern.sub(REDACTED, text)
                lowered = None
    return TOKEN_PATTERN.sub(REDACTED, text)


def holds_secret(value: str, secrets: Iterable[str | None]) -> bool:
    """True when ``value`` is one of ``secrets`` in any case, surrounding whitespace ignored,
    or contains one (secrets of 8 characters or more; a shorter one only as the whole value,
    so a short test token does not refuse every path that happens to contain it)."""
    folded = value.strip().casefold()
    for secret in secrets:
        core = str(secret or "").strip().casefold()
        if len(core) < _MIN_SECRET:
            continue
        if folded == core or (len(core) >= _MIN_INSIDE and core in folded):
            return True
    return False
