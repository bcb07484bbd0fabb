"""A `StructuredOutputs` -> an xgrammar `Grammar`, with no tokenizer: the API process builds it
to reject a bad constraint with a 400 before the engine sees it, the engine compiles the same
grammar against the vocabulary (compiler.py). Also small combinators (`literal`, `concat`,
`union`, `json_value`, `regex`) from which serve/chat_format/tool_grammar.py builds the DSML
tool-call grammar, shipped as EBNF text (`to_ebnf`)."""
from __future__ import annotations

import json
import re
from collections import OrderedDict

from ..sampling_params import StructuredOutputs

# JSON-schema keywords xgrammar would silently ignore (the output would not honour them):
# a schema using one is refused rather than answered with output that may not validate.
UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired",
                        "patternProperties", "propertyNames", "unevaluatedProperties",
                        "unevaluatedItems", "contains", "uniqueItems", "multipleOf")
MAX_SCHEMA_DEPTH = 32          # nesting of a schema (and of $ref chains) we accept
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message names the field and the problem."""


class CompileFailed(GrammarError):
    """xgrammar refused a built grammar when compiling it (compiler.GrammarCache: the message
    names the problem alone; `named` adds the field, as `build_checked` words it)."""

    def named(self, spec: StructuredOutputs) -> GrammarError:
        return GrammarError(f"{field_of(spec)}: {self}")


def field_of(spec: StructuredOutputs) -> str:
    """The request field a constraint came from (the start of its errors)."""
    return _FIELD[spec.kinds()[0] if spec.kinds() else "json"]


def _xgr():
    import xgrammar
    return xgrammar


def build(spec: StructuredOutputs):
    """The xgrammar Grammar of a constraint; raises GrammarError naming the problem."""
    xgr = _xgr()
    try:
        if spec.json_object:
            return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
        if spec.json is not None:
            return xgr.Grammar.from_json_schema(check_schema(spec.json), any_whitespace=False)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            return union(*[literal(c) for c in spec.choice])
        return xgr.Grammar.from_ebnf(spec.grammar)
    except GrammarError:
        raise
    except Exception as e:      # xgrammar's errors (RuntimeError, its own types) all mean a bad constraint
        raise GrammarError(f"{field_of(spec)}: {clean_error(e)}") from None


def build_checked(spec: StructuredOutputs):
    """`build`, then `compile_check`ed."""
    grammar = build(spec)
    try:
        compile_check(grammar)
    except Exception as e:      # noqa: BLE001 - as in build: any xgrammar error means a bad constraint
        raise GrammarError(f"{field_of(spec)}: {clean_error(e)}") from None
    return grammar


def compile_check(grammar):
    """`grammar`, after compiling it against a one-token vocabulary (~0.1 ms for a small grammar):
    xgrammar checks some grammars only when it compiles them (`"minLength": -5` is a negative
    repetition bound), and such a grammar must fail its own request, never the engine's grammar
    worker (whose failure ends every constrained request in flight: remote.py). Raises
    xgrammar's error."""
    xgr = _xgr()
    xgr.GrammarCompiler(xgr.TokenizerInfo(["a"]), max_threads=1, cache_enabled=False).compile_grammar(grammar)
    return grammar


# A constraint up to this many characters is built and checked when its request is added (a
# few ms at most), so a bad one raises there; a larger one is checked by its compile, off the
# step path, and fails its request from there (docs/architecture.md, "Structured outputs").
CHECK_AT_ADD_CHARS = 4096


def spec_chars(spec: StructuredOutputs) -> int:
    """The constraint's size in characters (its text, or its choices' summed)."""
    return sum(len(t) for t in (spec.json, spec.regex, spec.grammar) if t) + sum(map(len, spec.choice or ()))


class CheckedSpecs:
    """`build_checked` once per constraint: an LRU of the keys it accepted."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._keys: OrderedDict[tuple, None] = OrderedDict()

    def check(self, spec: StructuredOutputs) -> None:
        """Raises GrammarError for a bad constraint."""
        key = spec.key()
        if key in self._keys:
            self._keys.move_to_end(key)
            return
        build_checked(spec)
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


_FIELD = {"json": "json_schema", "json_object": "response_format", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}


def clean_error(e: Exception) -> str:
    """The first line of an xgrammar error, without its C++ source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _CPP_PREFIX.sub("", text)


def check_schema(text: str) -> str:
    """The schema text, after refusing what xgrammar would not enforce: a keyword from
    UNSUPPORTED_KEYWORDS, or nesting / $ref chains deeper than MAX_SCHEMA_DEPTH."""
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise GrammarError(f"json_schema: not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("json_schema: must be a JSON object")
    _walk(schema, schema, "", 0, set())
    return text


def _walk(node, root, where: str, depth: int, refs: set) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        shown = where if len(where) <= 60 else "..." + where[-60:]
        raise GrammarError(f"json_schema: nests deeper than {MAX_SCHEMA_DEPTH} levels at {shown}")
    if isinstance(node, list):
        for i, item in enumerate(node):
            _walk(item, root, f"{where}/{i}", depth + 1, refs)
        return
    if not isinstance(node, dict):
        return
    names_map = where.rsplit("/", 1)[-1] in ("properties", "$defs", "definitions")   # keys are names here
    for key in () if names_map else UNSUPPORTED_KEYWORDS:
        if key in node:
            raise GrammarError(f"json_schema: the keyword {key!r} at {where or '/'} is not supported")
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target = _resolve(root, ref)
        if target is None:
            raise GrammarError(f"json_schema: $ref {ref!r} at {where or '/'} points nowhere")
        if ref not in refs:
            _walk(target, root, ref[1:], depth + 1, refs | {ref})
    for key, value in node.items():
        if key not in ("enum", "const", "default", "examples", "$ref") and isinstance(value, (dict, list)):
            _walk(value, root, f"{where}/{key}", depth + 1, refs)


def _resolve(root, ref: str):
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


# ---- combinators ------------------------------------------------------------------------
def literal(text: str):
    return _xgr().Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}" if text else 'root ::= ""')


def regex(pattern: str):
    return _xgr().Grammar.from_regex(pattern)


def json_value(schema: dict):
    """One JSON value following `schema` (compact: no whitespace between tokens)."""
    return _xgr().Grammar.from_json_schema(check_schema(json.dumps(schema)), any_whitespace=False)


def concat(*parts):
    return _xgr().Grammar.concat(*parts) if len(parts) > 1 else parts[0]


def union(*parts):
    return _xgr().Grammar.union(*parts) if len(parts) > 1 else parts[0]


def to_ebnf(grammar) -> str:
    return str(grammar)
