"""A small JSON-schema validator: the subset that structured outputs and tool parameters use (type, enum, const,
properties, required, additionalProperties, items, min/max items, lengths and values, pattern, anyOf / oneOf /
allOf). ``agentenv policy verify`` checks an endpoint's JSON and tool arguments with it; it says why a value is
not valid rather than whether, so that a failed check names the path. Standard library only.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer(),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
}


def schema_errors(value: Any, schema: dict[str, Any] | bool, path: str = "$") -> list[str]:
    """Why ``value`` is not valid under ``schema`` (empty when it is): type, enum, const, properties, required,
    additionalProperties, items, min/max items, lengths and values, pattern, anyOf / oneOf / allOf."""
    if schema is True or schema == {}:
        return []
    if schema is False:
        return [f"{path}: no value is allowed here"]
    assert isinstance(schema, dict)
    errs: list[str] = []
    kinds = schema.get("type")
    if kinds is not None:
        names = kinds if isinstance(kinds, list) else [kinds]
        if not any(_TYPES.get(k, lambda v: True)(value) for k in names):
            return [f"{path}: {json.dumps(value)[:40]} is not of type {kinds}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {json.dumps(value)[:40]} is not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errs.append(f"{path}: must be {schema['const']!r}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errs += [f"{path}: missing required {k!r}" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            if k in props:
                errs += schema_errors(v, props[k], f"{path}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{path}: unexpected property {k!r}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errs += schema_errors(v, schema["additionalProperties"], f"{path}.{k}")
    if isinstance(value, list):
        if isinstance(schema.get("items"), dict):
            for i, v in enumerate(value):
                errs += schema_errors(v, schema["items"], f"{path}[{i}]")
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", math.inf):
            errs.append(f"{path}: {len(value)} items is out of range")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", math.inf):
            errs.append(f"{path}: length {len(value)} is out of range")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errs.append(f"{path}: does not match {schema['pattern']!r}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        lo, hi = schema.get("minimum", -math.inf), schema.get("maximum", math.inf)
        if value < lo or value > hi:
            errs.append(f"{path}: {value} is out of [{lo}, {hi}]")
        if value <= schema.get("exclusiveMinimum", -math.inf) or value >= schema.get("exclusiveMaximum", math.inf):
            errs.append(f"{path}: {value} is out of the exclusive range")
    for sub in schema.get("allOf", []):
        errs += schema_errors(value, sub, path)
    if "anyOf" in schema and all(schema_errors(value, s, path) for s in schema["anyOf"]):
        errs.append(f"{path}: matches none of anyOf")
    if "oneOf" in schema and sum(not schema_errors(value, s, path) for s in schema["oneOf"]) != 1:
        errs.append(f"{path}: does not match exactly one of oneOf")
    return errs
