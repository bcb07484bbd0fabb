"""OpenAI-format chat messages -> a DeepSeek-V4 prompt string (V4 ships no Jinja template).

Compatible byte for byte with DeepSeek's reference encoder (`encoding/encoding_dsv4.py` of the
checkpoints; vLLM `vllm/tokenizers/deepseek_v4_encoding.py`, SGLang `encoding_dsv4.py`), whose
rules are followed here step by step:
  1. tool messages are merged into user turns as <tool_result> blocks, and the results of one
     assistant turn are put in the order of its tool calls (merge_tool_messages,
     sort_tool_results_by_call_order);
  2. in thinking mode, unless some message carries tools, reasoning is dropped from assistant
     turns before the last user turn, and developer messages there are dropped
     (_drop_thinking_messages);
  3. each message is rendered, followed by `<｜Assistant｜>` + `<think>` or `</think>` where
     the assistant is to speak next (render_message).
Request-level `tools` go on the leading system/developer message, or on an empty system
message put in front (vLLM `vllm/tokenizers/deepseek_v4.py`; SGLang differs only when the
first message is a developer one: it puts an empty system message before it). Neither server
hands `response_format` to the encoder; here it goes on the same message, after the tools,
where the reference renders a message's own response_format.
Choices where the references leave a gap: a list of text parts is joined with "\\n" (vLLM's
chat parsing; SGLang joins with " "), and a tool result given as a list of parts follows the
reference encoder's own rule ("\\n\\n" between parts, "[Unsupported TYPE]" for non-text ones).
"""

from __future__ import annotations

from typing import Any

from dsv4.serve.chat_format.dsml import BLOCK_SEPARATOR, render_tool_calls, render_tools, to_json
from dsv4.serve.chat_format.release import effort_prefix
from dsv4.text.tokens import (ASSISTANT, BOS, EOS, LATEST_REMINDER, TASK_TOKENS, THINK_END,
                               THINK_START, USER)

_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
_RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def encode_messages(messages: list[dict], *, thinking: bool, reasoning_effort: str | None = None,
                    tools: list[dict] | None = None, response_format: dict | None = None,
                    release: str = "0731", add_generation_prompt: bool = True,
                    drop_thinking: bool = True, continue_final_message: bool = False) -> str:
    """The prompt for `messages`. `tools` are OpenAI tools ({"type": "function", ...});
    `reasoning_effort` must be one the release accepts (release.REASONING_EFFORTS).
    `add_generation_prompt=False` leaves out the `<｜Assistant｜>` + think token after a final
    user/developer message (a task's tokens stay). `continue_final_message`: the last
    message is an assistant turn the model goes on with: no EOS after it, and in thinking
    mode, when it has reasoning but no content, no `</think>` either (see
    `continuation_channel`). Messages may also carry the reference's extras: role
    "latest_reminder", "task" (a TASK_TOKENS name) and "wo_eos".
    Raises ValueError for a message the format cannot express."""
    prefix = effort_prefix(release, reasoning_effort, thinking)
    if not messages:
        raise ValueError("messages is empty")
    msgs = [_normalize(m) for m in messages]
    if continue_final_message:
        msgs[-1] = _open_final_turn(msgs[-1])
    msgs = _attach_request_options(msgs, tools, response_format)
    msgs = _sort_tool_results(_merge_tool_results(msgs))
    # Invariant from here on: no "tool" role; every user message has "blocks".
    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        msgs = _drop_old_turns(msgs)
    parts = [BOS, prefix]
    for index in range(len(msgs)):
        parts.append(_render(index, msgs, thinking, drop))
        parts.append(_transition(index, msgs, thinking, drop, add_generation_prompt))
    return "".join(parts)


def continuation_channel(messages: list[dict], thinking: bool) -> str:
    """Where the model's text goes when it continues the final assistant message:
    "reasoning" (thinking mode, the message has no content or tool calls yet) or "content"."""
    last = _normalize(messages[-1])
    prev_has_task = len(messages) > 1 and messages[-2].get("task") is not None
    open_reasoning = thinking and not prev_has_task and not last.get("content") and not last.get("tool_calls")
    return "reasoning" if open_reasoning else "content"


def _open_final_turn(msg: dict) -> dict:
    if msg["role"] != "assistant":
        raise ValueError("continue_final_message: the last message must be an assistant message")
    if msg["tool_calls"]:
        raise ValueError("continue_final_message: the message to continue has tool_calls")
    return {**msg, "wo_eos": True, "open_reasoning": not msg["content"]}


# ---- input normalisation ----------------------------------------------------------------

def _normalize(message: dict) -> dict:
    """A copy in the encoder's terms: text content, "reasoning", known role."""
    if not isinstance(message, dict):
        raise ValueError(f"a message must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in _ROLES:
        raise ValueError(f"unsupported message role {role!r}")
    msg = {k: message[k] for k in ("role", "task", "wo_eos", "tool_call_id", "tools",
                                    "response_format") if k in message}
    content = message.get("content")
    msg["content"] = content if role == "tool" and isinstance(content, list) else _text(content, role)
    if role == "assistant":
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        msg["reasoning"] = _text(reasoning, role)
        msg["tool_calls"] = list(message.get("tool_calls") or [])
        _check_functions(msg["tool_calls"], "tool call")
    _check_functions(msg.get("tools") or [], "tool")
    if msg.get("task") is not None and msg["task"] not in TASK_TOKENS:
        raise ValueError(f"unknown task {msg['task']!r}; expected one of {list(TASK_TOKENS)}")
    return msg


def _text(content: Any, role: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{role} message: only text content parts are supported, got {kind!r}")
            texts.append(part.get("text") or "")
        return "\n".join(texts)
    raise ValueError(f"{role} message: content must be a string or a list of parts")


def _check_functions(items: list, what: str) -> None:
    """Tools and tool calls are OpenAI objects with a named "function"."""
    for item in items:
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"each {what} needs a function with a name, got {item!r}")


def _attach_request_options(msgs: list[dict], tools: list[dict] | None,
                            response_format: dict | None) -> list[dict]:
    if not tools and not response_format:
        return msgs
    if msgs[0]["role"] in ("system", "developer"):
        head, rest = dict(msgs[0]), msgs[1:]
    else:
        head, rest = {"role": "system", "content": ""}, msgs
    if tools:
        _check_functions(tools, "tool")
        head["tools"] = tools  # request-level tools replace any on the message
    if response_format:
        head["response_format"] = response_format
    return [head, *rest]


# ---- the reference's preprocessing --------------------------------------------------------

def _merge_tool_results(msgs: list[dict]) -> list[dict]:
    """Tool messages become tool_result blocks of a user turn; consecutive user turns (without
    a task) and tool results merge into one user turn, in arrival order."""
    merged: list[dict] = []
    for msg in msgs:
        last = merged[-1] if merged and merged[-1]["role"] == "user" else None
        if msg["role"] == "tool":
            block = {"type": "tool_result", "id": msg.get("tool_call_id") or "",
                     "content": msg["content"]}
            if last is not None:
                last["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif msg["role"] == "user":
            block = {"type": "text", "text": msg["content"]}
            if last is not None and last.get("task") is None:
                last["blocks"].append(block)
            else:
                merged.append({**msg, "blocks": [block]})
        else:
            merged.append(msg)
    return merged


def _sort_tool_results(msgs: list[dict]) -> list[dict]:
    """Within a user turn, put tool results in the order of the latest assistant tool calls
    (a stable sort; an unknown id sorts as position 0), leaving text blocks in place."""
    order: dict[str, int] = {}
    for msg in msgs:
        if msg["role"] == "assistant" and msg["tool_calls"]:
            order = {}
            for position, call in enumerate(msg["tool_calls"]):
                call_id = call.get("id") or (call.get("function") or {}).get("id")
                if call_id:
                    order[call_id] = position
        elif msg["role"] == "user":
            results = [b for b in msg["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1 and order:
                results.sort(key=lambda block: order.get(block["id"], 0))
                ordered = iter(results)
                msg["blocks"] = [next(ordered) if b["type"] == "tool_result" else b
                                 for b in msg["blocks"]]
    return msgs


def _last_user_index(msgs: list[dict]) -> int:
    return max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)


def _drop_old_turns(msgs: list[dict]) -> list[dict]:
    """Before the last user turn: assistant turns lose their reasoning, developer turns go."""
    last_user = _last_user_index(msgs)
    kept = []
    for index, msg in enumerate(msgs):
        if msg["role"] in ("user", "system", "latest_reminder") or index >= last_user:
            kept.append(msg)
        elif msg["role"] == "assistant":
            kept.append({**msg, "reasoning": ""})
    return kept


# ---- rendering ------------------------------------------------------------------------------

def _render(index: int, msgs: list[dict], thinking: bool, drop: bool) -> str:
    msg = msgs[index]
    role = msg["role"]
    if role == "system":
        return msg["content"] + _instructions(msg)
    if role == "developer":
        if not msg["content"]:
            raise ValueError("a developer message needs content")
        return USER + msg["content"] + _instructions(msg)
    if role == "user":
        return USER + "\n\n".join(_render_block(b) for b in msg["blocks"])
    if role == "latest_reminder":
        return LATEST_REMINDER + msg["content"]
    prev_has_task = index > 0 and msgs[index - 1].get("task") is not None
    keep_reasoning = (thinking and not prev_has_task
                      and (not drop or index > _last_user_index(msgs)))
    return _render_assistant(msg, keep_reasoning)


def _instructions(msg: dict) -> str:
    """The tools and response-format sections a system/developer message carries."""
    text = ""
    if msg.get("tools"):
        text += "\n\n" + render_tools(msg["tools"])
    if msg.get("response_format"):
        text += "\n\n" + _RESPONSE_FORMAT + to_json(msg["response_format"])
    return text


def _render_block(block: dict) -> str:
    if block["type"] == "text":
        return block["text"]
    content = block["content"]
    if isinstance(content, list):
        content = "\n\n".join(
            (part.get("text") or "") if part.get("type") == "text"
            else f"[Unsupported {part.get('type')}]"
            for part in content)
    return f"<tool_result>{content}</tool_result>"


def _render_assistant(msg: dict, keep_reasoning: bool) -> str:
    """An assistant turn: [reasoning</think>] content [\\n\\n tool-call block] [EOS]. With
    `keep_reasoning` this is exactly the text the model generates for the turn."""
    if keep_reasoning and msg.get("open_reasoning"):
        return msg.get("reasoning") or ""      # a continued turn still reasoning
    text = (msg.get("reasoning") or "") + THINK_END if keep_reasoning else ""
    text += msg.get("content") or ""
    if msg.get("tool_calls"):
        text += BLOCK_SEPARATOR + render_tool_calls(msg["tool_calls"])
    return text if msg.get("wo_eos") else text + EOS


def _transition(index: int, msgs: list[dict], thinking: bool, drop: bool,
                add_generation_prompt: bool) -> str:
    """What follows message `index` when the assistant (or a task) speaks next."""
    msg = msgs[index]
    is_last = index + 1 == len(msgs)
    if not is_last and msgs[index + 1]["role"] not in ("assistant", "latest_reminder"):
        return ""
    task = msg.get("task")
    if task is not None:
        if task != "action":
            return TASK_TOKENS[task]
        return ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task]
    if msg["role"] not in ("user", "developer") or (is_last and not add_generation_prompt):
        return ""
    open_thinking = thinking and (not drop or index >= _last_user_index(msgs))
    return ASSISTANT + (THINK_START if open_thinking else THINK_END)
