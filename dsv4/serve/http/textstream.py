"""Engine token ids of one choice -> text, and logprobs in OpenAI's two formats.

Stop strings are the engine's job (it has the tokenizer and ends the request); here the
text is only *released* so that nothing after a stop string is ever sent: the last
`stream_holdback_chars` characters wait until the next token or the end, and at the end
the engine's final text (cut at the stop string) decides what remains.
"""
from __future__ import annotations

from ...sampling_params import SamplingParams
from ...text.stop import StopChecker
from ...engine.ipc import LogprobEntry, TokenOutput


class TextStream:
    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self._detok = tokenizer.detokenizer(prompt_ids, skip_special_tokens=params.skip_special_tokens)
        self._holdback = StopChecker(params, None).stream_holdback_chars
        self.text = ""         # released so far
        self._pending = ""     # decoded, not released yet

    def push(self, out: TokenOutput) -> str:
        """The text released by this output (all that is left when it is the last)."""
        for tid in out.token_ids:
            self._pending += self._detok.push(tid)
        if out.finished:
            released = self._finish(out.final_text)
        else:
            cut = max(0, len(self._pending) - self._holdback)
            released, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += released
        return released

    def _finish(self, final_text: str | None) -> str:
        if final_text is None:
            rest = self._pending + self._detok.flush()
        elif final_text.startswith(self.text):
            rest = final_text[len(self.text):]
        else:
            rest = ""   # never send what may lie past the stop string
        self._pending = ""
        return rest


class TokenTexts:
    """Token id -> its text (special tokens included), memoised."""

    def __init__(self, tokenizer):
        self._tokenizer, self._cache = tokenizer, {}

    def __call__(self, tid: int) -> str:
        text = self._cache.get(tid)
        if text is None:
            text = self._cache[tid] = self._tokenizer.decode([tid], skip_special_tokens=False)
        return text


def chat_logprobs(entries: list[LogprobEntry], top: int, texts: TokenTexts) -> list[dict]:
    """`choices[].logprobs.content` items: the chosen token and its `top` best alternatives."""
    items = []
    for entry in entries:
        tid, lp = entry[0]
        best = sorted(entry, key=lambda pair: -pair[1])[:top]
        items.append({**_token(tid, lp, texts),
                      "top_logprobs": [_token(t, v, texts) for t, v in best]})
    return items


def _token(tid: int, lp: float, texts: TokenTexts) -> dict:
    text = texts(tid)
    return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}


class LegacyLogprobs:
    """`/v1/completions` logprobs: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, top: int, texts: TokenTexts, offset: int = 0):
        self.top, self.texts, self.offset = top, texts, offset

    def build(self, token_ids: list[int], entries: list[LogprobEntry | None],
              offsets: list[int] | None = None) -> dict:
        """`offsets`: each token's place in the returned text (default: running on from
        `self.offset` by the token's own text)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, (tid, entry) in enumerate(zip(token_ids, entries)):
            text = self.texts(tid)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset if offsets is None else offsets[i])
            self.offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            lookup = dict(entry)
            out["token_logprobs"].append(_finite(lookup[tid]))
            best = sorted(entry, key=lambda pair: -pair[1])[:self.top]
            out["top_logprobs"].append({self.texts(t): _finite(v) for t, v in best})
        return out


def prompt_offsets(tokenizer, ids: list[int], skip_special_tokens: bool, skip_first: bool, text_len: int) -> list[int]:
    """Where each prompt token starts in the echoed prompt text (`text_len` characters):
    the length of what the tokens before it decode to (a prepended BOS, `skip_first`, adds
    nothing), never past the text, never decreasing."""
    detok = tokenizer.detokenizer([], skip_special_tokens=skip_special_tokens)
    offsets, done = [], 0
    for i, tid in enumerate(ids):
        offsets.append(min(done, text_len))
        if not (skip_first and i == 0):
            done += len(detok.push(tid))
    return offsets


def vllm_prompt_logprobs(entries: list[LogprobEntry | None], top: int, texts: TokenTexts) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id:
    {logprob, rank, decoded_token}} for the actual token (an entry's first pair) and the
    `top` best. Ranks count the listed tokens that are more likely, so they are exact for
    the best `top`; the actual token, when it is not among them, has rank null (unknown)."""
    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        actual_in_top = len(entry) == top
        shown = {}
        for i, (tid, lp) in enumerate(entry):
            rank = 1 + sum(1 for _, other in entry if other > lp)
            shown[str(tid)] = {"logprob": _finite(lp), "rank": rank if i > 0 or actual_in_top else None,
                               "decoded_token": texts(tid)}
        out.append(shown)
    return out


def _finite(value: float) -> float:
    """JSON has no -inf: clamp as vLLM does."""
    return max(value, -9999.0)
