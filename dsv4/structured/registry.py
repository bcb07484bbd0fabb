"""The engine's grammars: one `RequestGrammar` per constrained request, compiled through one
`GrammarCache`. Created by the engine on the first constrained request, so an engine that
never sees one never imports xgrammar."""
from __future__ import annotations

import torch

from ..sampling_params import StructuredOutputs
from ..text.tokens import DSML, EOS, SPECIAL_TOKENS, THINK_END
from .compiler import GrammarCache
from .matcher import RequestGrammar


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int):
        if tokenizer is None:
            raise ValueError("structured outputs need the checkpoint's tokenizer (tokenizer.json)")
        self.cache = GrammarCache(tokenizer, vocab_size, eos_token_id)
        self.think_end_id = tokenizer.token_to_id(THINK_END)
        self.vocab_size = vocab_size
        self.keep = special_token_filter(tokenizer, vocab_size)
        self._requests: dict[str, RequestGrammar] = {}

    def add(self, request_id: str, spec: StructuredOutputs) -> RequestGrammar:
        """Raises grammars.GrammarError (a ValueError naming the problem) for a bad constraint."""
        grammar = RequestGrammar(self.cache.get(spec), self.think_end_id, spec.after_think, self.keep)
        self._requests[request_id] = grammar
        return grammar

    def get(self, request_id: str) -> RequestGrammar | None:
        return self._requests.get(request_id)

    def drop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)


def special_token_filter(tokenizer, vocab_size: int) -> torch.Tensor:
    """[ceil(V / 32)] int32: every bit set but those of V4's special tokens, DSML's marker and
    EOS excepted (a tool-call block writes the first; the grammar's end allows only the second)."""
    keep = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)
    for text in SPECIAL_TOKENS:
        tid = tokenizer.token_to_id(text)
        if text not in (DSML, EOS) and tid is not None and tid < vocab_size:
            keep[tid // 32] &= ~(1 << (tid % 32)) if tid % 32 != 31 else 0x7FFFFFFF
    return keep
