"""The engine's grammars: one `RequestGrammar` per constrained request, compiled through one
`GrammarCache`. Created by the engine on the first constrained request, so an engine that
never sees one never imports xgrammar."""
from __future__ import annotations

import torch

from ..sampling_params import StructuredOutputs
from ..text.tokens import DSML, EOS, SPECIAL_TOKENS, THINK_END
from .compiler import GrammarCache
from .masks import MaskFiller, verify_mask
from .matcher import RequestGrammar


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int):
        if tokenizer is None:
            raise ValueError("structured outputs need the checkpoint's tokenizer (tokenizer.json)")
        self.cache = GrammarCache(tokenizer, vocab_size, eos_token_id)
        self.think_end_id = tokenizer.token_to_id(THINK_END)
        self.vocab_size = vocab_size
        self.keep = special_token_filter(tokenizer, vocab_size)
        self.end_row, self.eos_token_id = only_token(eos_token_id, vocab_size), eos_token_id
        self.masks = MaskFiller(vocab_size, self.keep)      # decode steps' masks
        self._requests: dict[str, RequestGrammar] = {}
        self.error: str | None = None       # (never set here: remote.WorkerGrammars's worker death)

    def add(self, request_id: str, spec: StructuredOutputs) -> RequestGrammar:
        """Raises grammars.GrammarError (a ValueError naming the problem) for a bad constraint."""
        grammar = RequestGrammar(self.cache.get(spec), self.think_end_id, spec.after_think, self.end_row,
                                 self.eos_token_id)
        self._requests[request_id] = grammar
        return grammar

    def get(self, request_id: str) -> RequestGrammar | None:
        return self._requests.get(request_id)

    def drop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def step_masks(self, request_ids: list[str], taken: list[tuple[RequestGrammar, int]] = ()):
        """One id per sampling row -> masks.PendingMask of the rows under a grammar (filled on
        the worker thread for a large batch), or None. `taken`: the previous step's tokens, one
        per grammar, that the matchers accept first (masks.MaskFiller.start)."""
        return self.masks.start([self._requests.get(rid) for rid in request_ids], taken)

    def accept(self, taken: list[tuple[RequestGrammar, int]]) -> None:
        """The matchers take the (grammar, token) pairs in order, one token at a time, with no
        mask to fill after (a speculative step's tokens, or a step sampled without waiting)."""
        self.masks.idle()
        for grammar, token in taken:
            grammar.accept(token)

    def verify_masks(self, chunks: list[tuple[str, list[int]]]):
        """Per verify chunk (its request id, its drafts) -> masks.GrammarMask of its rows, or None."""
        return verify_mask([(self._requests.get(rid), d) for rid, d in chunks], self.vocab_size, self.keep)

    def close(self) -> None:
        self.masks.close()


def only_token(token_id: int, vocab_size: int) -> torch.Tensor:
    """[ceil(V / 32)] int32 with the bit of `token_id` alone set."""
    row = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    bit = token_id % 32
    row[token_id // 32] = 1 << bit if bit != 31 else -2**31
    return row


def special_token_filter(tokenizer, vocab_size: int) -> torch.Tensor:
    """[ceil(V / 32)] int32: every bit set but those of V4's special tokens, DSML's marker and
    EOS excepted (a tool-call block writes the first; the grammar's end allows only the second)."""
    keep = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)
    for text in SPECIAL_TOKENS:
        tid = tokenizer.token_to_id(text)
        if text not in (DSML, EOS) and tid is not None and tid < vocab_size:
            keep[tid // 32] &= ~(1 << (tid % 32)) if tid % 32 != 31 else 0x7FFFFFFF
    return keep
