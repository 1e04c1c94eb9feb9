"""Keeping the Hub token out of text: every spelling of a secret, and values marked secret.

:func:`scrub` is the one scrubber (the transports, the coordinator, the MetricLogger and the
CLI all use it). A token can reach text in more spellings than its raw form: with the
whitespace a secret file or a ``secretKeyRef`` added (``hf_x\\n``), escaped by ``repr`` or
JSON (``hf_x\\\\n``), inside header bytes (``b'Bearer hf_x\\n'``), percent-encoded or base64
encoded, and in another case: a choice field lowercases what it is given before it checks it.
:func:`secret_forms` lists them; ``scrub`` replaces each (longest first, in any letter case)
by ``<redacted>``, and also anything shaped like a Hub token (``hf_`` + 20 or more letters
and digits) whose value we were not told. :func:`holds_secret` tells whether a value is, or
contains, a secret (any case, whitespace stripped): the config layer refuses such a value in
any field but the token's own, so no name built from the config (a tracker run, a directory)
can carry it.

:class:`SecretText` marks a string that came from a secret (a secret file, ``HF_TOKEN``): the
config layer wraps such values before validation, so an error about a field never prints
one even when it landed in the wrong field (:func:`contains_secret`). Validation turns every
accepted value back into a plain ``str``.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Iterable, Mapping
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


def contains_secret(value: object, *, _depth: int = 0) -> bool:
    """True when ``value`` is, or holds (lists, tuples, mappings), a :class:`SecretText` or a
    token-shaped string. The walk is bounded (depth 32, 1000 items per container)."""
    if isinstance(value, str):
        return isinstance(value, SecretText) or looks_like_token(value)
    if _depth >= 32:
        return False
    if isinstance(value, Mapping):
        items: Iterable[object] = [*list(value.keys())[:1000], *list(value.values())[:1000]]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)[:1000]
    else:
        return False
    return any(contains_secret(item, _depth=_depth + 1) for item in items)


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
