"""DSML, V4's tool-call markup: the tools section of a prompt and the tool-call block.

Written from DeepSeek's reference encoder (`encoding_dsv4.py`: TOOLS_TEMPLATE, render_tools,
tool_call_template, tool_calls_template, encode_arguments_to_dsml, decode_dsml_to_arguments).
A block, as the encoder writes it after an assistant's content and the parser reads it:

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

String values are written as is (`string="true"`); every other value as JSON (`"false"`).
"""

from __future__ import annotations

import json
from typing import Any

from dsv4.text.tokens import DSML, THINK_END, THINK_START

# Literal pieces of a block (the parser matches exactly these).
BLOCK_OPEN = f"<{DSML}tool_calls>"
BLOCK_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f'<{DSML}invoke name="'
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f'<{DSML}parameter name="'
PARAM_CLOSE = f"</{DSML}parameter>"
# The separator the encoder puts between an assistant's content and its block.
BLOCK_SEPARATOR = "\n\n"

_TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def to_json(value: Any) -> str:
    """JSON as the reference writes it: default separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict]) -> str:
    """The tools section for OpenAI-format tools ({"type": "function", "function": {...}});
    each function object is written as one JSON line, keys in the order given."""
    schemas = "\n".join(to_json(tool["function"]) for tool in tools)
    return _TOOLS_TEMPLATE.format(dsml=DSML, think_start=THINK_START, think_end=THINK_END,
                                  schemas=schemas)


def tool_call_arguments(arguments: Any) -> dict:
    """The arguments of an OpenAI tool call as a dict. None or a blank string is no
    arguments (as vLLM reads them); a JSON string that does not parse is kept whole under
    the key "arguments", as SGLang's copy of the reference does."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except RecursionError:
            raise ValueError("tool call arguments nest too deeply to parse") from None
        except ValueError:
            return {"arguments": arguments}
        if isinstance(parsed, dict):
            _check_unicode(parsed)
            return parsed
    raise ValueError(f"tool call arguments must be a JSON object, got {arguments!r}")


def _check_unicode(parsed: dict) -> None:
    """JSON's `\\ud800` escapes decode to lone surrogates, which no prompt can carry."""
    try:
        to_json(parsed).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"tool call arguments contain a lone UTF-16 surrogate at character {e.start} "
                         f"of their JSON; strings must be valid Unicode") from None


def render_tool_calls(tool_calls: list[dict]) -> str:
    """The block for OpenAI-format tool calls, without the separator before it."""
    invokes = [_render_invoke(tc["function"]["name"],
                              tool_call_arguments(tc["function"].get("arguments")))
               for tc in tool_calls]
    return f"{BLOCK_OPEN}\n" + "\n".join(invokes) + f"\n{BLOCK_CLOSE}"


def _render_invoke(name: str, arguments: dict) -> str:
    params = "\n".join(_render_param(key, value) for key, value in arguments.items())
    return f'{INVOKE_OPEN}{name}">\n{params}\n{INVOKE_CLOSE}'


def _render_param(key: str, value: Any) -> str:
    is_string = isinstance(value, str)
    text = value if is_string else to_json(value)
    flag = "true" if is_string else "false"
    return f'{PARAM_OPEN}{key}" string="{flag}">{text}{PARAM_CLOSE}'

