"""What the field declarations publish: the JSON Schema and the docs' field tables.

Both are generated from the models, never written by hand: ``speedtronic config schema``
prints :func:`json_schema` (committed as ``docs/speedtronic.schema.json``, which every
``configs/*.yaml`` names on its first line for editors), and ``speedtronic config docs``
prints :func:`field_tables` (the "Fields" part of docs/configuration.md). Tests fail when
either committed copy differs from the models.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic.fields import FieldInfo

from speedtronic.config.fields import fields_of
from speedtronic.config.loading import ROOT_FIELDS, RUN_ALIASES, SECTION_NAMES

__all__ = ["SCHEMA_ID", "field_tables", "json_schema", "schema_text"]

SCHEMA_ID = "https://speedtronic.dev/schema/config.json"
BEGIN, END = "<!-- fields:begin (speedtronic config docs) -->", "<!-- fields:end -->"


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a config file, 2.0.0 aliases and shorthands included.

    Numbers also accept strings (PyYAML reads ``3e-4`` as a string), so the schema checks
    names, nesting, choices and ranges of what a file writes, as the loader reads it.
    """
    from pydantic import TypeAdapter

    from speedtronic.config.schema import SpeedtronicConfig

    schema = TypeAdapter(SpeedtronicConfig).json_schema()
    defs = schema.get("$defs", {})
    props = schema["properties"]
    run = defs["RunConfig"]["properties"]
    for alias in RUN_ALIASES:
        props[alias] = run[alias]
    props["hub"] = props["diloco"] = {"$ref": "#/$defs/DistributedConfig"}
    for flag in ("muon_plus", "cautious"):
        props[flag] = {"type": "boolean"}
    props["optimizer"] = {"anyOf": [{"$ref": "#/$defs/OptimizerConfig"}, {"type": "string"}]}
    props["precision"] = {"anyOf": [{"$ref": "#/$defs/PrecisionConfig"}, {"type": "string"}]}
    enabled = {"enabled": {"type": "boolean"}}
    mapping = {"type": "object", "properties": enabled, "additionalProperties": False}
    props["compile"] = {"anyOf": [{"type": "boolean"}, mapping]}
    for name in SECTION_NAMES:
        props[name] = {"anyOf": [props[name], {"type": "null"}]}
    for definition in defs.values():
        definition["additionalProperties"] = False
    schema.update({"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID})
    schema["additionalProperties"] = False
    schema["title"] = "Speedtronic configuration"
    return {key: _lenient_numbers(value) for key, value in schema.items()}


def _lenient_numbers(node: object) -> object:
    """Let a numeric leaf also be a numeric string (``lr: 3e-4`` is a string to PyYAML)."""
    if isinstance(node, dict):
        node = {key: _lenient_numbers(value) for key, value in node.items()}
        if node.get("type") in ("number", "integer"):
            text = {"type": "string", "pattern": r"^\s*[-+]?[0-9.]+([eE][-+]?[0-9]+)?\s*$"}
            return {"anyOf": [node, text]}
        return node
    if isinstance(node, list):
        return [_lenient_numbers(item) for item in node]
    return node


def schema_text() -> str:
    """:func:`json_schema` as committed: indented JSON with a final newline."""
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def _type_name(prop: dict[str, Any]) -> str:
    """A property of the JSON Schema in words: ``integer``, ``auto | none | integer``, ..."""
    if "const" in prop:
        return f"`{prop['const']}`"
    if "enum" in prop:
        return " \\| ".join(f"`{item}`" for item in prop["enum"])
    if "anyOf" in prop:
        return " \\| ".join(_type_name(member) for member in prop["anyOf"])
    if prop.get("type") == "array" and "prefixItems" in prop:
        return f"pair of {_type_name(prop['prefixItems'][0])}"
    if prop.get("type") == "array":
        return f"list of {_type_name(prop.get('items', {}))}"
    return str(prop.get("type", "any"))


def _constraints(info: FieldInfo) -> list[object]:
    """A field's constraints: its own, plus what ``Annotated`` members of its type carry
    (``Steps | None`` keeps the bounds of ``Steps`` inside the union)."""
    found = list(info.metadata)
    stack = list(typing.get_args(info.annotation))
    while stack:
        arg = stack.pop()
        if typing.get_origin(arg) is typing.Annotated:
            for item in arg.__metadata__:
                found.extend(item.metadata if isinstance(item, FieldInfo) else [item])
            stack.append(arg.__origin__)
        elif typing.get_origin(arg) in (typing.Union, types.UnionType):
            stack.extend(typing.get_args(arg))
    return found


def _number(value: object) -> str:
    """A bound in the docs: ``1e+12``, ``0.001``, ``65535``."""
    return f"{value:g}" if isinstance(value, float) else repr(value)


def _range(info: FieldInfo) -> str:
    """``> 0, <= 1024``: the field's bounds in the docs' words."""
    words = {Gt: (">", "gt"), Ge: (">=", "ge"), Lt: ("<", "lt"), Le: ("<=", "le")}
    low, high = "", ""
    for item in _constraints(info):
        for kind, (sign, name) in words.items():
            if isinstance(item, kind):
                text = f"{sign} {_number(getattr(item, name))}"
                low, high = (text, high) if kind in (Gt, Ge) else (low, text)
    return ", ".join(part for part in (low, high) if part)


def _default(info: FieldInfo) -> str:
    value = info.default
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value)}`" if not isinstance(value, str) else f"`{value}`"


def field_tables() -> str:
    """Markdown: one table per section (field, type, default, range, help), then the roots."""
    from pydantic import TypeAdapter

    from speedtronic.config.schema import SECTION_CLASSES, SpeedtronicConfig

    schema = TypeAdapter(SpeedtronicConfig).json_schema()
    groups = [
        (f"`{name}`", fields_of(cls), schema["$defs"][cls.__name__]["properties"])
        for name, cls in SECTION_CLASSES.items()
    ]
    roots = fields_of(SpeedtronicConfig)
    groups.append(("Root scalars", {n: roots[n] for n in ROOT_FIELDS}, schema["properties"]))
    lines = [BEGIN, ""]
    for title, fields, props in groups:
        lines += [f"### {title}", "", "| Field | Type | Default | Range | Meaning |"]
        lines.append("|---|---|---|---|---|")
        for name, info in fields.items():
            cells = (f"`{name}`", _type_name(props[name]), _default(info), _range(info))
            lines.append(f"| {' | '.join(cells)} | {info.description} |")
        lines.append("")
    return "\n".join([*lines, END]) + "\n"
