"""Stop strings checked where the text is made: in the API process (docs/architecture.md,
"Serving"), as vLLM's output processor does. The engine ends requests on EOS, stop token ids
and lengths only; the API process detokenises each request's new tokens incrementally, finds a
stop string the moment its last character arrives, cuts the output there and aborts the
request in the engine (tokens the engine generated meanwhile are dropped).

`StopStringWatch.push` gives the same cut and text as `StopChecker` over the full decode after
every token (the engine's rule, kept by the offline `LLM`): the incremental text is the full
decode (text/detokenizer.py) and the search window is the same.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .stop import StopChecker


class StopStringWatch:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], params: SamplingParams):
        """tokenizer: anything with `decode(ids, skip_special_tokens=...)`."""
        self._detok = IncrementalDetokenizer(tokenizer.decode, list(prompt_ids), params.skip_special_tokens)
        self._checker = StopChecker(params, None)
        self.text = ""              # the output text so far
        self.num_tokens = 0         # output tokens pushed so far

    def push(self, token_ids: Sequence[int]) -> tuple[int, str, str] | None:
        """The next output tokens, in order. When a stop string ends at one of them: (how many
        of these tokens to keep, the matched stop string, the final text cut at it), else None."""
        for i, tid in enumerate(token_ids):
            delta = self._detok.push(tid)
            self.text += delta
            self.num_tokens += 1
            if delta and self.num_tokens > self._checker.params.min_tokens:
                hit = self._checker.find_stop_string(self.text, len(delta))
                if hit is not None:
                    return i + 1, hit.stop_reason, hit.output_text
        return None
