"""Request fields the server does not know: the policy (README, "Unknown fields").

* Fields that ask for something this server cannot do (a whitespace pattern, the legacy
  function-calling fields) are always a 400 naming the field: silently dropping them would
  return an answer the client did not ask for.
* Any other unknown field, top-level or nested (`messages.0.foo`): with `--strict-api` a 400
  naming it; by default the request runs, the field is ignored, the response carries the
  names in the `X-Ignored-Fields` header, and the log warns once per field name.

Request models keep unknown keys (`extra="allow"`) only until `take_unknown` has collected
and removed them, so nothing downstream ever sees one.
"""
from __future__ import annotations

import logging
import threading
from urllib.parse import quote

from pydantic import BaseModel

from .errors import bad_request

log = logging.getLogger("dsv4.serve")
HEADER = "X-Ignored-Fields"
UNSUPPORTED = {
    "guided_whitespace_pattern": "not supported: JSON constraints write compact JSON",
    "functions": "the legacy function-calling fields are not supported; use tools",
    "function_call": "the legacy function-calling fields are not supported; use tool_choice",
}

MAX_WARNED = 1000        # distinct names remembered for warn-once (then no more warnings)
MAX_HEADER_NAMES = 32

_warned: set[str] = set()
_warned_lock = threading.Lock()


def take_unknown(req: BaseModel, strict: bool) -> list[str]:
    """The unknown fields of a parsed request as dotted paths (removed from it); raises the
    400s described above."""
    found = _collect(req, "")
    for path in found:
        if path in UNSUPPORTED:
            raise bad_request(f"{path}: {UNSUPPORTED[path]}", path)
    if found and strict:
        raise bad_request(f"{found[0]}: unknown field (this server runs with --strict-api)", found[0])
    _warn_once(found)
    return found


def _collect(model: BaseModel, prefix: str) -> list[str]:
    extra = model.__pydantic_extra__
    found = [prefix + name for name in extra or ()]
    if extra:
        extra.clear()
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{prefix}{name}." + (f"{i}." if isinstance(value, list) else "")
                found += _collect(item, where)
    return found


def _warn_once(paths: list[str]) -> None:
    names = {".".join(p for p in path.split(".") if not p.isdigit()) for path in paths}
    with _warned_lock:
        new = sorted(names - _warned)[:max(0, MAX_WARNED - len(_warned))]
        _warned.update(new)
    for name in new:
        log.warning("ignoring the unknown request field %r (warned once; start with --strict-api to reject "
                    "unknown fields)", name)


def with_header(response, ignored: list[str]):
    """Name the ignored fields in the response (ASCII-escaped, at most MAX_HEADER_NAMES)."""
    if ignored:
        names = [_header_safe(p) for p in ignored[:MAX_HEADER_NAMES]]
        response.headers[HEADER] = ", ".join(names) + (", ..." if len(ignored) > MAX_HEADER_NAMES else "")
    return response


def _header_safe(name: str) -> str:
    """Percent-encoded (RFC 3986) past letters, digits and `._-~`: any name is a valid,
    unambiguous header token."""
    return quote(name[:100], safe="._-~")
