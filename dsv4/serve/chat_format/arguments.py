"""One tool call's OpenAI `arguments` JSON, written piece by piece as its DSML parameters
arrive (docs/architecture.md, "Chat format").

The pieces concatenate to `{"k": <value>, ...}` with json.dumps' separators, which is what
DeepSeek's reference `decode_dsml_to_arguments` gives for canonical output. A string value
the schema allows as a string streams character by character; any other value is held
until its close tag, then converted to the declared types (schema_values.py) and written
whole. Beyond the reference, which raises on these:
  * a repeated parameter keeps its first value (the repeat is dropped, noted in the log);
  * a lone `arguments` (or `input`) parameter that the tool's schema does not declare, and
    whose value is an object of declared properties, is unwrapped into the arguments;
  * an invoke body written as a JSON object instead of parameters is taken as the arguments.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from dsv4.serve.chat_format.dsml import to_json
from dsv4.serve.chat_format.schema_values import allows_string, convert_text, declared_types

logger = logging.getLogger(__name__)

WRAPPER_NAMES = ("arguments", "input")
STREAM, HOLD, UNWRAP, DISCARD = "stream", "hold", "unwrap", "discard"


class ArgumentWriter:
    def __init__(self, tool: str, schema: dict | None, emit: Callable[[str], None]):
        self.tool = tool
        props = (schema or {}).get("properties") if isinstance(schema, dict) else None
        self._props: dict | None = props if isinstance(props, dict) else None
        self._emit = emit
        self._written: list[str] = []      # keys written so far, in order
        self._seen: set[str] = set()       # parameter names opened so far
        self._mode = DISCARD
        self._name, self._is_string = "", None
        self._held: list[str] = []         # a held value's text, or the invoke's body text

    # ---- parameters ------------------------------------------------------------------------
    def open_param(self, name: str | None, is_string: bool | None) -> None:
        self._name, self._is_string, self._held = name or "", is_string, []
        self._mode = self._mode_for(name, is_string)
        if name is not None:
            self._seen.add(name)
        if self._mode == STREAM:
            self._key(name)
            self._emit('"')

    def _mode_for(self, name: str | None, is_string: bool | None) -> str:
        if name is None or name in self._seen or name in self._written:
            logger.info("tool call %s: parameter %r %s; dropped", self.tool, name,
                        "has no name" if name is None else "repeats")
            return DISCARD
        if self._props is not None and name in WRAPPER_NAMES and name not in self._props:
            return UNWRAP
        types = declared_types(self._props.get(name)) if self._props else None
        if is_string is not False and allows_string(types) and (is_string or types == {"string"}):
            return STREAM
        return HOLD

    def value(self, text: str) -> None:
        if self._mode == STREAM:
            if text:
                self._emit(to_json(text)[1:-1])
        elif self._mode != DISCARD:
            self._held.append(text)

    def close_param(self) -> None:
        text, mode = "".join(self._held), self._mode
        self._mode, self._held = DISCARD, []
        if mode == STREAM:
            self._emit('"')
        elif mode == HOLD:
            self._write(self._name, self._convert(self._name, text, self._is_string))
        elif mode == UNWRAP:
            self._unwrap(text)

    # ---- the invoke ------------------------------------------------------------------------
    def body_text(self, text: str) -> None:
        """Text inside the invoke but outside any parameter."""
        self._held.append(text)

    def close(self) -> None:
        """The invoke closed: write any JSON body, then the closing brace."""
        body = "".join(self._held).strip()
        if body and not self._seen:
            self._write_body(body)
        elif body:
            logger.info("tool call %s: text outside parameters dropped: %r", self.tool, body[:80])
        self._emit("}" if self._written else "{}")

    def _write_body(self, body: str) -> None:
        try:
            args = json.loads(body)
        except (ValueError, RecursionError):      # (RecursionError: JSON nested too deeply to parse)
            args = None
        if not isinstance(args, dict):
            logger.info("tool call %s: invoke body is not a JSON object; dropped: %r", self.tool, body[:80])
            return
        wrapper = self._spurious_wrapper(args)
        for key, value in (wrapper or args).items():
            self._write(key, self._fit(key, value))

    # ---- helpers ---------------------------------------------------------------------------
    def _unwrap(self, text: str) -> None:
        inner = self._convert(self._name, text, False)
        if isinstance(inner, dict) and set(inner) <= set(self._props):
            for key, value in inner.items():
                self._write(key, self._fit(key, value))
        else:
            self._write(self._name, inner if not self._is_string else text)

    def _spurious_wrapper(self, args: dict) -> dict | None:
        if self._props is None or len(args) != 1:
            return None
        (key, value), = args.items()
        if key in WRAPPER_NAMES and key not in self._props and isinstance(value, dict) \
                and set(value) <= set(self._props):
            return value
        return None

    def _convert(self, name: str, text: str, is_string: bool | None) -> Any:
        schema = self._props.get(name) if self._props else None
        return convert_text(text, is_string, schema, f"{self.tool}.{name}")

    def _fit(self, name: str, value: Any) -> Any:
        if isinstance(value, str) and self._props and not allows_string(declared_types(self._props.get(name))):
            return self._convert(name, value, None)
        return value

    def _write(self, name: str, value: Any) -> None:
        if name in self._written:
            logger.info("tool call %s: parameter %r repeats; dropped", self.tool, name)
            return
        self._key(name)
        self._emit(to_json(value))

    def _key(self, name: str) -> None:
        self._emit(("{" if not self._written else ", ") + to_json(name) + ": ")
        self._written.append(name)
