"""The engine's grammars: one `RequestGrammar` per constrained request, compiled through one
`GrammarCache`. Created by the engine on the first constrained request, so an engine that
never sees one never imports xgrammar."""
from __future__ import annotations

from ..sampling_params import StructuredOutputs
from ..text.tokens import THINK_END
from .compiler import GrammarCache
from .matcher import RequestGrammar


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int):
        if tokenizer is None:
            raise ValueError("structured outputs need the checkpoint's tokenizer (tokenizer.json)")
        self.cache = GrammarCache(tokenizer, vocab_size, eos_token_id)
        self.think_end_id = tokenizer.token_to_id(THINK_END)
        self.vocab_size = vocab_size
        self._requests: dict[str, RequestGrammar] = {}

    def add(self, request_id: str, spec: StructuredOutputs) -> RequestGrammar:
        """Raises grammars.GrammarError (a ValueError naming the problem) for a bad constraint."""
        grammar = RequestGrammar(self.cache.get(spec), self.think_end_id, spec.after_think)
        self._requests[request_id] = grammar
        return grammar

    def get(self, request_id: str) -> RequestGrammar | None:
        return self._requests.get(request_id)

    def drop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)
