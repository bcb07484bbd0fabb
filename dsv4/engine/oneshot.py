"""Whole-sequence logits through the paged path, with a throw-away cache sized for it:
what `dsv4 check` and the oracle tests compare against the reference."""
from __future__ import annotations

import torch

from ..cache.addressing import SeqChunk, build_step
from ..cache.layout import PAGE_TOKENS, SWA_PAGE_TOKENS, CacheLayout, CachePlan
from ..cache.storage import KVStorage
from ..model.forward_batch import ForwardBatch
from .upload import HostToDevice, upload_tree


class OneSequence:
    """A cache for one sequence of up to `n` tokens, pages in order; `batch(tokens)` is the
    ForwardBatch of a whole prefill of `tokens` (every row's logits) on the model's device."""

    def __init__(self, model, n: int, with_mtp: bool = False, kv_fp8: bool = False):
        self.device = next(model.parameters()).device
        self.layout = CacheLayout(model.cfg, with_mtp=with_mtp, kv_fp8=kv_fp8)
        self.pages, self.swa_pages = -(-n // PAGE_TOKENS), -(-n // SWA_PAGE_TOKENS)
        plan = CachePlan(num_pages=self.pages, num_swa_pages=self.swa_pages, max_num_seqs=1)
        self.storage = KVStorage(self.layout, plan, model.dtype, self.device)

    def batch(self, tokens: list[int]) -> ForwardBatch:
        chunk = SeqChunk(slot=0, start=0, token_ids=list(tokens), page_table=list(range(self.pages)),
                         swa_table=list(range(self.swa_pages)), logits=len(tokens))
        return upload_tree(build_step([chunk], self.layout, self.storage.ring_slots), HostToDevice(self.device))


@torch.no_grad()
def full_logits(model, token_ids: list[int], kv_fp8: bool = False) -> torch.Tensor:
    """One prefill of `token_ids` -> fp32 logits [len, vocab] for every position (kv_fp8: with
    the packed FP8 KV cache)."""
    one = OneSequence(model, len(token_ids), kv_fp8=kv_fp8)
    fb = one.batch(token_ids)
    return model.logits(model(fb, one.storage.layers)[fb.logits_rows])
