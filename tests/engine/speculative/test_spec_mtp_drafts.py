"""The MTP drafter's drafts are the MTP block's own predictions (model/mtp.py, the definition
scripts/demo/verify.py checks against training): after every engine step, each request's
drafts equal a from-scratch computation over its committed tokens — the main model over
x_0..x_{K-2}, the MTP block at every position t fed x_{t+1}, then k - 1 chained steps fed
the previous draft and the block's own output streams. This holds only if the engine's
catch-up covers exactly the window the block reads (chunked prefills, prompts longer than
the window) and if the keys that rejected drafts wrote are overwritten before they are read.

On the random tiny model drafts are almost always rejected; on the trained demo model they
are accepted in runs of every length (and the acceptance is that of a trained drafter)."""
from __future__ import annotations

import pytest
import torch

from dsv4.cache.addressing import SeqChunk, build_step
from dsv4.engine.oneshot import OneSequence
from dsv4.engine.upload import HostToDevice, upload_tree
from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
MARGIN = 1e-3


@torch.no_grad()
def reference_drafts(model, seq: list[int], k: int) -> list[tuple[int, float]]:
    """(draft, its top-2 margin) for the k tokens after committed tokens `seq`."""
    K, mtp = len(seq), model.mtp[0]
    one = OneSequence(model, K + k, with_mtp=True)
    kv = one.storage.layers
    fb = one.batch(seq[:-1])                     # positions 0 .. K-2
    h = model(fb, kv)
    streams = mtp.draft(model, h, one.batch(seq[1:]), kv)[-1:]     # x_{t+1} at position t
    out = []
    for j in range(k):
        if j > 0:
            chunk = SeqChunk(0, K - 2 + j, [out[-1][0]], list(range(one.pages)), list(range(one.swa_pages)), logits=1)
            step = upload_tree(build_step([chunk], one.layout, one.storage.ring_slots), HostToDevice("cpu"))
            streams = mtp.draft(model, streams, step, kv)
        logits = mtp.logits(model, streams)[0]
        top = logits.topk(2).values
        out.append((int(logits.argmax()), float(top[0] - top[1])))
    return out


def check_drafts(engine, model, k: int, checked: list) -> None:
    for req in engine.scheduler.running:
        if not req.spec_token_ids or req.num_remaining != 1:
            continue
        ref = reference_drafts(model, req.prompt_token_ids + req.output_token_ids, len(req.spec_token_ids))
        for j, (draft, (want, margin)) in enumerate(zip(engine.spec.drafts_of(req), ref)):
            if margin < MARGIN:
                break
            assert draft == want, (f"{req.request_id} after {len(req.output_token_ids)} tokens: draft {j} is "
                                   f"{draft}, the MTP block predicts {want}")
            checked.append(j)


def run_checked(engine, model, prompts: list[list[int]], max_tokens: int, k: int, sp):
    checked = []
    reqs = [sp.Req(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]
    sp.drive(engine, reqs, on_step=lambda e, s: check_drafts(e, model, k, checked))
    return checked


@pytest.mark.parametrize("k", [1, 3])
def test_drafts_equal_the_mtp_block_on_chunked_prompts_past_the_window(tiny, sp, k):
    """Window 32; prompts of 70 and 45 tokens prefilled in chunks of at most 40 beside the
    other's decode: the first chunk's catch-up starts at 70 - 32."""
    eng = tiny.engine(speculative_config=sp.spec(k), max_num_batched_tokens=40, max_num_seqs=4, num_pages=8)
    checked = run_checked(eng, tiny.model, [tiny.tie_free_ids(70, seed=5), tiny.tie_free_ids(45, seed=6)], 24, k, sp)
    assert len(checked) >= 30 and (k == 1 or max(checked) == k - 1)


def test_drafts_equal_the_mtp_block_on_the_demo_model(demo, sp):
    """The trained drafter: runs of accepted drafts of every length, and each step's drafts
    still equal the block's predictions from scratch."""
    from dsv4.engine.engine import LLMEngine
    from dsv4.config import EngineConfig
    k = 3
    eng = LLMEngine(demo.path, EngineConfig(speculative_config=sp.spec(k), max_num_batched_tokens=256,
                                            max_num_seqs=4, num_pages=8), model=demo.model)
    lengths = []
    record = eng.spec.stats.record
    eng.spec.stats.record = lambda d, a: lengths.append(a) or record(d, a)
    checked = run_checked(eng, demo.model, demo.prompts[:2], 40, k, sp)
    assert len(checked) >= 40
    assert set(lengths) == {0, 1, 2, 3}, f"accepted run lengths {sorted(set(lengths))}"
    assert eng.spec.stats.mean_acceptance_length > 1.8
