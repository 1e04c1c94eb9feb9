""" "Did you mean": the configuration name a user most likely meant.

Pure functions over the names they are given (the config layer passes its field names and
environment names), so a typo is answered the same way wherever it is written:

- `closest_field`: a dotted field for an unknown ``--set`` key (``optimzer.lr`` ->
  ``optimizer.lr``; ``run.lr`` -> ``optimizer.lr``, the one field of that name);
- `misspelt_prefix`: the ``SPEEDTRONIC_*`` name an environment variable meant when its prefix
  is a near miss and the rest names a field (``SPEEDTONIC_RUN__MAX_STEPS``,
  ``SPEEDTRONICS_RUN_MAX_STEPS`` -> ``SPEEDTRONIC_RUN__MAX_STEPS``). Such a variable sets
  nothing, so the layer refuses it as it refuses an unknown ``SPEEDTRONIC_*`` name.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

__all__ = ["PREFIX_CUTOFF", "closest_field", "misspelt_prefix"]

#: How alike (difflib ratio) a variable's prefix must be to ``SPEEDTRONIC`` to count as a typo
#: of it: ``SPEEDTONIC`` 0.95, ``SPEED_TRONIC`` 0.96; ``SPEEDTEST`` 0.6 is someone else's.
PREFIX_CUTOFF = 0.8
FIELD_CUTOFF = 0.75


def closest_field(key: str, fields: Iterable[str]) -> str | None:
    """The known dotted field an unknown ``key`` most likely meant: the most similar name
    (`difflib`, a dropped or swapped letter, a misspelt section), else the field of that
    name in another section; None when nothing is close."""
    names = list(fields)
    wanted = key.strip().lower()
    close = difflib.get_close_matches(wanted, names, n=1, cutoff=FIELD_CUTOFF)
    if close:
        return close[0]
    leaf = wanted.rpartition(".")[2]
    same = [name for name in names if name.rpartition(".")[2] == leaf]
    return same[0] if same else None


def misspelt_prefix(name: str, prefix: str, suffixes: Mapping[str, str]) -> str | None:
    """The environment name ``name`` meant when it is ``<near-miss prefix><suffix>``.

    ``prefix`` is the real one (``SPEEDTRONIC_``); ``suffixes`` maps each field's name after
    it (``RUN__MAX_STEPS``, ``COMPILE``) to the full name. The suffix may also be written with
    one ``_`` between section and field (``RUN_MAX_STEPS``). A name that starts with
    ``prefix`` is not a near miss (the layer checks those itself). Case is ignored.
    """
    upper = name.upper()
    if upper.startswith(prefix):
        return None
    core = prefix.rstrip("_")
    variants = {suffix: full for suffix, full in suffixes.items()}
    variants.update({s.replace("__", "_"): full for s, full in suffixes.items() if "__" in s})
    for suffix in sorted(variants, key=len, reverse=True):  # the longest field name first
        if not upper.endswith(suffix) or len(upper) == len(suffix):
            continue
        head = upper[: -len(suffix)].rstrip("_-")
        alike = difflib.SequenceMatcher(None, head.replace("_", ""), core).ratio()
        if alike >= PREFIX_CUTOFF:
            return variants[suffix]
    return None
