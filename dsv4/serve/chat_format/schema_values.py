"""Tool-call parameter values against the request's JSON schemas (docs/architecture.md,
"Chat format"): the types a property declares, and a value converted to them.

`declared_types` reads `type` (a name or a list), `enum`/`const`, and the members of
`anyOf`/`oneOf`/`allOf`; None means "anything" (no schema, `$ref`, or no type said).
Loose spellings some schemas use ("int", "bool", "str", ...) count as their JSON names.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

_ALIASES = {"int": "integer", "long": "integer", "float": "number", "double": "number",
            "decimal": "number", "bool": "boolean", "str": "string", "text": "string",
            "varchar": "string", "dict": "object", "map": "object", "list": "array",
            "tuple": "array", "none": "null"}
_JSON_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")
_CONVERSION_ORDER = ("integer", "number", "boolean", "null", "array", "object")
_NO = object()    # "no conversion" (None is a value)


def declared_types(schema: Any) -> frozenset[str] | None:
    """The JSON types `schema` allows; None when it does not restrict them."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        kind = [kind]
    if isinstance(kind, list):
        names = {_ALIASES.get(str(k).lower(), str(k).lower()) for k in kind}
        return frozenset(n for n in names if n in _JSON_TYPES) or None
    if "enum" in schema and isinstance(schema["enum"], list):
        return frozenset(type_of(v) for v in schema["enum"]) or None
    if "const" in schema:
        return frozenset([type_of(schema["const"])])
    members = [m for key in ("anyOf", "oneOf", "allOf") if isinstance(schema.get(key), list) for m in schema[key]]
    if members:
        union = [declared_types(m) for m in members]
        return None if any(u is None for u in union) else frozenset().union(*union)
    return None


def type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "null")


def allows_string(types: frozenset[str] | None) -> bool:
    return types is None or "string" in types


def fits(value: Any, types: frozenset[str] | None) -> bool:
    if types is None:
        return True
    kind = type_of(value)
    return kind in types or (kind == "integer" and "number" in types)


def convert_text(text: str, is_string: bool | None, schema: Any, where: str) -> Any:
    """The value of a parameter written as `text`. is_string: the tag's string="true|false"
    (None: no flag). A string="true" value is the text itself unless the schema rules out
    strings; anything else is JSON. The result is then fitted to the declared types; a
    string="false" value that is not JSON stays a string, noted in the log."""
    types = declared_types(schema)
    if is_string and allows_string(types):
        return text
    if is_string is None and types == frozenset(["string"]):
        return text
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):      # (RecursionError: JSON nested too deeply to parse)
        if is_string is False:
            logger.info("tool call %s: %r is not JSON; kept as a string", where, text[:80])
        return conform(text, types, where)
    return conform(value, types, where)


def conform(value: Any, types: frozenset[str] | None, where: str) -> Any:
    """`value` converted to one of `types` when it does not fit them already and a lossless
    conversion exists (a string holding a number, boolean, null, array or object; an
    integral float for an integer); else `value` unchanged (noted in the log). Nothing is
    turned into a string: a JSON value written for a string property stays what it is, as
    the reference and both peers read it."""
    if fits(value, types):
        return value
    for kind in _CONVERSION_ORDER:
        if kind in types:
            converted = _to(kind, value)
            if converted is not _NO:
                return converted
    logger.info("tool call %s: %r does not fit the schema's types %s; kept as is",
                where, str(value)[:80], sorted(types))
    return value


def _to(kind: str, value: Any) -> Any:
    if isinstance(value, float) and kind == "integer" and value.is_integer():
        return int(value)
    if not isinstance(value, str):
        return _NO
    text = value.strip()
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind == "null" and text.lower() in ("null", "none"):
        return None
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):      # (RecursionError: JSON nested too deeply to parse)
        return _NO
    if fits(parsed, frozenset([kind])):
        return parsed
    return _to(kind, parsed) if kind == "integer" else _NO    # "3.0" -> 3
