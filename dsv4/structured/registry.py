"""The engine's grammars: one `RequestGrammar` per constrained request, compiled through one
`GrammarCache`. Created by the engine on the first constrained request, so an engine that
never sees one never imports xgrammar.

`add(background=True)` (the engine's) compiles a constraint not in the cache on the compile
thread (compile_thread.py): the request has no grammar (`get` is None) until `compiled()`,
called by the owner between steps, makes its matcher; a constraint up to
`grammars.CHECK_AT_ADD_CHARS` is checked at `add` first, so a bad one still raises there."""
from __future__ import annotations

import itertools

import torch

from ..sampling_params import StructuredOutputs
from ..text.tokens import DSML, EOS, SPECIAL_TOKENS, THINK_END
from .compile_thread import CompileThread
from .compiler import CACHE_ENTRIES, GrammarCache
from .grammars import CHECK_AT_ADD_CHARS, CheckedSpecs, CompileFailed, GrammarError, spec_chars
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
        # handle -> (its constraint, its ticket: a handle added again after a drop is not the old compile's)
        self._compiling: dict[object, tuple[StructuredOutputs, int]] = {}
        self._tickets = itertools.count()
        self._checks = CheckedSpecs(CACHE_ENTRIES)
        self._thread: CompileThread | None = None     # started by the first background compile
        self.notify = None          # notify(handle, error | None) on the compile thread, once a result is
        #                             queued (the grammar worker's notices)
        self.error: str | None = None       # (never set here: remote.WorkerGrammars's worker death)

    def add(self, request_id, spec: StructuredOutputs, background: bool = False,
            checked: bool = False) -> RequestGrammar | None:
        """The request's matcher; None while its constraint compiles on the compile thread
        (`background`, not cached). Raises grammars.GrammarError (a ValueError naming the
        problem) for a bad constraint (in the background: one over CHECK_AT_ADD_CHARS fails
        from `compiled()` instead). checked: the caller has checked it already (the grammar
        worker: the engine's WorkerGrammars.add did), so it is not checked again here."""
        compiled = self.cache.lookup(spec) if background else self.cache.get(spec)
        if compiled is None:
            if not checked and spec_chars(spec) <= CHECK_AT_ADD_CHARS:
                self._checks.check(spec)
            if self._thread is None:
                self._thread = CompileThread(self._compile, self._notify)
            ticket = next(self._tickets)
            self._compiling[request_id] = (spec, ticket)
            self._thread.submit((request_id, ticket), spec)
            return None
        return self._matcher(request_id, spec, compiled)

    def _compile(self, spec: StructuredOutputs):
        """The compile thread's job: the cache's compile, a refusal worded as `build_checked`'s
        (the error the request would get from a check at `add`)."""
        try:
            return self.cache.get(spec)
        except CompileFailed as e:
            raise e.named(spec) from None

    def _notify(self, handle: tuple, error: str | None) -> None:
        if self.notify is not None:
            self.notify(handle[0], error)

    def _matcher(self, request_id, spec: StructuredOutputs, compiled) -> RequestGrammar:
        grammar = RequestGrammar(compiled, self.think_end_id, spec.after_think, self.end_row, self.eos_token_id)
        self._requests[request_id] = grammar
        return grammar

    def compiled(self) -> list[tuple[object, GrammarError | None]]:
        """The background compiles finished since the last call, each request's matcher made
        (error None) or its GrammarError; requests dropped meanwhile are left out. Never waits."""
        done = []
        for (request_id, ticket), compiled, error in self._thread.take() if self._thread is not None else ():
            spec, current = self._compiling.get(request_id, (None, -1))
            if current != ticket:
                continue
            del self._compiling[request_id]
            if error is None:
                self._matcher(request_id, spec, compiled)
            done.append((request_id, error))
        return done

    def wait_compiled(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a background compile to finish."""
        if self._compiling and self._thread is not None:
            self._thread.wait(timeout)

    def get(self, request_id) -> RequestGrammar | None:
        return self._requests.get(request_id)

    def drop(self, request_id) -> None:
        self._requests.pop(request_id, None)
        self._compiling.pop(request_id, None)       # (its compile's result is dropped by `compiled`)

    def __len__(self) -> int:
        return len(self._requests) + len(self._compiling)

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
        if self._thread is not None:
            self._thread.close()


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
