"""The text of DeepSeek-V4's special tokens, shared by the tokenizer, encoder and parsers.

The strings are the ones DeepSeek's reference encoder (`encoding/encoding_dsv4.py`, mirrored
as vLLM `vllm/tokenizers/deepseek_v4_encoding.py` and SGLang `encoding_dsv4.py`) writes into
prompts; a V4 tokenizer maps each of them to a single id.
"""

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

# Quick-instruction task tokens, keyed by the task name a message may carry.
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# Every V4 special token in a fixed order; a tokenizer trained by this project gives token i
# of this list the id i (so BOS is 0 and EOS is 1, as in the released checkpoints).
SPECIAL_TOKENS = [
    BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, DSML,
    *TASK_TOKENS.values(),
]
