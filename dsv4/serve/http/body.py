"""A request body -> a JSON object every later step can carry, or a 400 saying why not.

Invariants of what `read_json` returns: a dict; nested at most `MAX_DEPTH` containers deep
(so no later recursive walk, pydantic's included, can overflow the stack); every string
(keys too) encodes as UTF-8 (JSON's `\\ud800` escapes decode to lone surrogates, which the
tokenizer, msgspec on the engine wire and the JSON response writer all refuse).
"""
from __future__ import annotations

import json

from .errors import bad_request

MAX_DEPTH = 64   # a chat request is ~6 deep; tool schemas nest a few levels more


def read_json(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    check_tree(data)
    return data


def check_tree(data: dict) -> None:
    """Walk the tree without recursion; 400 naming the first bad place."""
    stack: list[tuple[object, tuple, int]] = [(data, (), 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels", _name(path))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            where = (*path, key)
            if isinstance(key, str):
                _check_text(key, path)
            if isinstance(value, str):
                _check_text(value, where)
            elif isinstance(value, (dict, list)):
                stack.append((value, where, depth + 1))


def _check_text(text: str, where: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        name = _name(where)
        raise bad_request(f"{name or 'body'}: contains a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) "
                          f"at character {e.start}; strings must be valid Unicode", name) from None


def _name(path: tuple) -> str | None:
    return ".".join(str(p) for p in path) or None
