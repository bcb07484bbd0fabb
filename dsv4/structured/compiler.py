"""Compiled grammars for one tokenizer, cached by constraint (an LRU bounded in entries).

`TokenizerInfo` is built once from the checkpoint's tokenizer (byte-level BPE) with EOS as the
only stop token: a matcher whose grammar is complete allows EOS alone, so a finished
constraint ends the request. `get` may run on the registry's compile thread
(compile_thread.py) while the owner's thread calls `lookup`: the entries are touched under a
lock, never held while compiling."""
from __future__ import annotations

import threading
from collections import OrderedDict

from ..sampling_params import StructuredOutputs
from . import grammars

CACHE_ENTRIES = 256


def tokenizer_info(tokenizer, vocab_size: int, eos_token_id: int):
    """xgrammar's view of our `text.tokenizer.Tokenizer` (padded to the model's vocabulary)."""
    import xgrammar
    from tokenizers import Tokenizer as HfTokenizer
    from transformers import PreTrainedTokenizerFast
    hf = tokenizer._hf if hasattr(tokenizer, "_hf") else tokenizer
    if isinstance(hf, HfTokenizer):
        hf = PreTrainedTokenizerFast(tokenizer_object=hf)
    return xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos_token_id])


class GrammarCache:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int, capacity: int = CACHE_ENTRIES):
        import xgrammar
        self.info = tokenizer_info(tokenizer, vocab_size, eos_token_id)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.vocab_size, self.capacity = vocab_size, capacity
        self._entries: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def lookup(self, spec: StructuredOutputs):
        """The CompiledGrammar of `spec` if cached (counted as a hit), else None; never compiles."""
        key = spec.key()
        with self._lock:
            compiled = self._entries.get(key)
            if compiled is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            return compiled

    def get(self, spec: StructuredOutputs):
        """The CompiledGrammar of `spec`; raises grammars.GrammarError for a bad one."""
        compiled = self.lookup(spec)
        if compiled is not None:
            return compiled
        self.misses += 1
        grammar = grammars.build(spec)
        try:
            compiled = self.compiler.compile_grammar(grammar)
        except Exception as e:      # noqa: BLE001 - some bad grammars fail only here (grammars.compile_check)
            raise grammars.CompileFailed(grammars.clean_error(e)) from None
        with self._lock:
            self._entries[spec.key()] = compiled
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._entries)
