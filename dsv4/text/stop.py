"""Decides, after each new token, whether a request is finished and why.

Independent of any tokenizer: it sees token ids and the detokenized output text. Rules,
in order (vLLM's semantics):
  1. nothing stops a request until it has generated more than `min_tokens` tokens (the
     token that stops it is the first one sampled with the min_tokens mask lifted);
  2. EOS (unless ignore_eos)            -> "stop", stop_reason None;
  3. one of stop_token_ids              -> "stop", stop_reason = that id;
  4. a stop string in the output text   -> "stop", stop_reason = that string, text
     truncated before it (or just after it with include_stop_str_in_output);
  5. max_tokens generated, or the context (prompt + output) reached max_model_len
                                        -> "length".
Stop strings are searched only in the text that could contain a new match: the last
`new_text_len` characters plus the `len(stop) - 1` before them, so a stop string spanning
token boundaries is found the moment its last character arrives.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsv4.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopResult:
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None  # matched stop token id or stop string; None otherwise
    output_text: str | None  # the request's final text (truncated at a stop string);
    # None when check() was given no text


class StopChecker:
    def __init__(self, params: SamplingParams, eos_token_id: int | None,
                 prompt_len: int = 0, max_model_len: int | None = None):
        self.params = params
        self.eos_token_id = None if params.ignore_eos else eos_token_id
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.max_model_len = max_model_len
        self.prompt_len = prompt_len

    @property
    def stream_holdback_chars(self) -> int:
        """Characters a streamer must hold back (until the request finishes) so that the
        beginning of a stop string excluded from the output is never sent early."""
        if not self.params.stop or self.params.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.params.stop) - 1

    def check(self, output_token_ids: Sequence[int], output_text: str | None = None,
              new_text_len: int | None = None) -> StopResult | None:
        """Call once per appended token. `output_text` is the detokenized output so far,
        `new_text_len` how many of its last characters the latest token added (None:
        search the whole text). Returns None while the request goes on."""
        num_output = len(output_token_ids)
        if num_output > self.params.min_tokens:
            last = output_token_ids[-1]
            if last == self.eos_token_id:
                return StopResult("stop", None, output_text)
            if last in self.stop_token_ids:
                return StopResult("stop", last, output_text)
            if output_text is not None and self.params.stop:
                matched = self.find_stop_string(output_text, new_text_len)
                if matched is not None:
                    return matched
        if num_output >= self.params.max_tokens or (
                self.max_model_len is not None
                and self.prompt_len + num_output >= self.max_model_len):
            return StopResult("length", None, output_text)
        return None

    def find_stop_string(self, text: str, new_text_len: int | None) -> StopResult | None:
        """The earliest stop string ending in the new text (ties: first in params.stop)."""
        new_start = 0 if new_text_len is None else len(text) - new_text_len
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            start = text.find(stop, max(0, new_start - len(stop) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        if best is None:
            return None
        start, stop = best
        end = start + len(stop) if self.params.include_stop_str_in_output else start
        return StopResult("stop", stop, text[:end])
