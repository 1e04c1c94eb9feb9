"""What the field declarations publish: the JSON Schema and the docs' field tables.

Both are generated from the models, never written by hand: ``speedtronic config schema``
prints :func:`json_schema` (committed as ``docs/speedtronic.schema.json``, which every
``configs/*.yaml`` names on its first line for editors), and ``speedtronic config docs``
prints :func:`field_tables` (the "Fields" part of docs/configuration.md). Tests fail when
either committed copy differs from the models.
"""

from __future__ import annotations

import json
from typing import Any

from speedtronic.config.loading import ROOT_FIELDS, RUN_ALIASES, SECTION_NAMES

__all__ = ["SCHEMA_ID", "field_tables", "json_schema", "schema_text"]

SCHEMA_ID = "https://speedtronic.dev/schema/config.json"
Schema = dict[str, Any]  # a JSON Schema document or property
BEGIN, END = "<!-- fields:begin (speedtronic config docs) -->", "<!-- fields:end -->"


def json_schema() -> Schema:
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


def _type_name(prop: Schema) -> str:
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


def _range(prop: object) -> str:
    """``> 0, <= 1024``: the bounds found anywhere in a property (a union, a pair's items)."""
    signs = {"exclusiveMinimum": ">", "minimum": ">=", "exclusiveMaximum": "<", "maximum": "<="}
    signs.update(gt=">", ge=">=", lt="<", le="<=")  # pydantic's words for a bound in a union
    bounds: dict[str, str] = {}
    stack = [prop]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, sign in signs.items():
                if key in node:
                    value = node[key]
                    shown = f"{value:g}" if isinstance(value, float) else repr(value)
                    bounds["low" if ">" in sign else "high"] = f"{sign} {shown}"
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return ", ".join(bounds[end] for end in ("low", "high") if end in bounds)


def _default(value: object) -> str:
    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


def field_tables() -> str:
    """Markdown: one table per section (field, type, default, range, help), then the roots."""
    from pydantic import TypeAdapter

    from speedtronic.config.schema import SECTION_CLASSES, SpeedtronicConfig

    schema = TypeAdapter(SpeedtronicConfig).json_schema()
    groups = [
        (f"`{name}`", schema["$defs"][cls.__name__]["properties"])
        for name, cls in SECTION_CLASSES.items()
    ]
    groups.append(("Root scalars", {n: schema["properties"][n] for n in ROOT_FIELDS}))
    lines = [BEGIN, ""]
    for title, props in groups:
        lines += [f"### {title}", "", "| Field | Type | Default | Range | Meaning |"]
        lines.append("|---|---|---|---|---|")
        for name, prop in props.items():
            cells = (f"`{name}`", _type_name(prop), _default(prop.get("default")), _range(prop))
            lines.append(f"| {' | '.join(cells)} | {prop.get('description')} |")
        lines.append("")
    return "\n".join([*lines, END]) + "\n"
