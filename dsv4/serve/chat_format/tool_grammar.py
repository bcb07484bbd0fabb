"""The grammar of a forced tool call (tool_choice "required" or a named function): the rest of
a DSML block after the prefill `chat_prompt._prefill` writes (dsml.py has the layout).

* required — after `\\n\\n<｜DSML｜tool_calls>\\n`: one invoke of any tool, then the block's close;
* named — after the invoke header of that tool: its parameters, the invoke's and block's close.

Parameters come in the schema's declared order, required ones always, optional ones or not.
A parameter whose schema is `"type": "string"` is written as DSML writes strings
(`string="true"`, the raw text, no `<` inside; an enum is one of its values); any other value as
compact JSON following its schema (`string="false"`). Returned as EBNF text
(`StructuredOutputs.grammar`), built from structured/grammars.py's combinators."""
from __future__ import annotations

from ...structured import grammars as g
from .dsml import BLOCK_CLOSE, INVOKE_CLOSE, INVOKE_OPEN, PARAM_CLOSE, PARAM_OPEN


def forced_call_grammar(tools: list[dict], named: str | None) -> str:
    """EBNF of what follows the prefill; raises grammars.GrammarError naming the tool and
    parameter whose schema cannot be compiled."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if named is not None:
        return g.to_ebnf(g.concat(_params(by_name[named]), g.literal(f"{INVOKE_CLOSE}\n{BLOCK_CLOSE}")))
    invokes = [g.concat(g.literal(f'{INVOKE_OPEN}{name}">\n'), _params(fn), g.literal(INVOKE_CLOSE))
               for name, fn in by_name.items()]
    return g.to_ebnf(g.concat(g.union(*invokes), g.literal(f"\n{BLOCK_CLOSE}")))


def _params(fn: dict):
    schema = fn.get("parameters") or {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    listed = schema.get("required")
    required = {r for r in listed if isinstance(r, str)} if isinstance(listed, list) else set()
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    parts = []
    for key, prop in props.items():
        try:
            one = g.compile_check(_param(key, {**prop, **defs} if isinstance(prop, dict) else prop))
        except Exception as e:      # GrammarError, or xgrammar's own error types
            raise g.GrammarError(f"tools: function {fn['name']!r}, parameter {key!r}: "
                                 f"{g.clean_error(e)}") from None
        parts.append(one if key in required else g.union(one, g.literal("")))
    return g.concat(*parts) if parts else g.literal("")


def _param(key: str, prop) -> object:
    if isinstance(prop, dict) and prop.get("type") == "string":
        head = g.literal(f'{PARAM_OPEN}{key}" string="true">')
        enum = prop.get("enum")
        value = (g.union(*[g.literal(v) for v in enum]) if enum and all(isinstance(v, str) and "<" not in v
                                                                         for v in enum)
                 else g.regex(_string_regex(prop)))
        return g.concat(head, value, g.literal(f"{PARAM_CLOSE}\n"))
    value = g.json_value(prop if isinstance(prop, dict) else {})
    return g.concat(g.literal(f'{PARAM_OPEN}{key}" string="false">'), value, g.literal(f"{PARAM_CLOSE}\n"))


def _string_regex(prop: dict) -> str:
    low = max(int(prop.get("minLength", 0) or 0), 0)
    high = prop.get("maxLength")
    return f"[^<]{{{low},{int(high)}}}" if isinstance(high, int) else f"[^<]{{{low},}}"
