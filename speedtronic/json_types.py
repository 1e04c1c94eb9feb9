"""The aliases for values whose shape is data, not code: JSON objects and torch state dicts.

A JSON object's values are checked where they are read (``float(payload["loss"])``), so its
value type stays open; naming it says what the value is without pretending to know more.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

JSON = dict[str, Any]
"""A JSON object: an event payload, a metadata record, a line of a ``.jsonl`` file."""

JSONView = Mapping[str, Any]
"""A JSON object that the callee only reads."""

StateDict = dict[str, Any]
"""A ``state_dict``: tensors and JSON-like values (torch calls it ``optimizer.StateDict``)."""
