"""`--kv-cache-dtype fp8` end to end (dsv4/ops/kv_fp8.py, docs/architecture.md "Cache"):

* the FP8 engine is the model-dtype engine whose every written KV row (SWA keys, C4 and C128
  entries, indexer keys) is rounded through the packed format: same logits (REL_TOL), so the
  quantisation sits exactly where rows are written and the readers dequantise exactly;
* against the model-dtype KV engine, the FP8 tolerance: median per-position max|Δlogit| at most
  5% of the logit scale and greedy agreement >= 85% on the random tiny model (the rest are
  indexer selections that FP8 keys flip);
* chunked == whole prefill under FP8 KV (REL_TOL, as in the model dtype), and the greedy
  tokens of a chunked run equal those of a whole-prompt run (invariant 5);
* storage: uint8 packed kinds, planner bytes equal to the allocated tensors;
* the prefix cache under FP8 KV (checkpoints of packed SWA rows, cache/checkpoint.py): a request
  resumed at each page boundary gives the logits of a cold FP8 engine (invariant 5).
"""
from __future__ import annotations

import pytest
import torch

import dsv4.model.attention as attention_module
import dsv4.model.compressor as compressor_module
from dsv4.ops import kv_fp8
from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def prefill_rows(tiny, stepper, tokens, sizes, **config):
    eng = tiny.engine(max_num_batched_tokens=512, max_num_seqs=2, num_pages=8, **config)
    return stepper.run(eng, stepper.request(tokens), sizes), eng


def round_through_fp8(monkeypatch, rope: int) -> None:
    """Model-dtype KV whose written rows are those an FP8 cache would read back."""
    norm_rope, close_groups = attention_module.norm_rope, compressor_module.close_groups

    def rounded_norm_rope(x, weight, eps, cos, sin, out=None, rows=None):
        if out is None:
            return norm_rope(x, weight, eps, cos, sin)
        y = norm_rope(x, weight, eps, cos, sin)
        out[rows] = kv_fp8.unpack_entries(kv_fp8.pack_entries(y, rope), y.shape[-1], rope).to(out.dtype)
        return out

    def rounded_close(*args):
        *head, pool, slots = args
        entries = torch.empty(slots.shape[0], pool.shape[1], dtype=pool.dtype)
        close_groups(*head, entries, torch.arange(slots.shape[0]))
        if pool.shape[1] == rope * 4:     # the tiny head_dim (64 = 4 x 16); index keys are 32 wide
            pool[slots] = kv_fp8.unpack_entries(kv_fp8.pack_entries(entries, rope), pool.shape[1], rope)
        else:
            pool[slots] = kv_fp8.unpack_index_keys(kv_fp8.pack_index_keys(entries))
    monkeypatch.setattr(attention_module, "norm_rope", rounded_norm_rope)
    monkeypatch.setattr(compressor_module, "close_groups", rounded_close)


def test_fp8_is_the_model_with_rows_rounded_where_written(tiny, h, stepper, monkeypatch):
    assert tiny.cfg.head_dim == 4 * tiny.cfg.qk_rope_head_dim and tiny.cfg.index_head_dim != tiny.cfg.head_dim
    tokens = tiny.tie_free_ids(300, seed=61)
    fp8, eng = prefill_rows(tiny, stepper, tokens, [300], kv_cache_dtype="fp8")
    assert eng.runner.storage.kinds["c4"].dtype == torch.uint8
    round_through_fp8(monkeypatch, tiny.cfg.qk_rope_head_dim)
    rounded, _ = prefill_rows(tiny, stepper, tokens, [300])
    h.assert_rows_close(fp8, rounded, range(300), "fp8 vs rows rounded through fp8")


def test_fp8_tolerance_against_model_dtype_kv(tiny, stepper):
    tokens = tiny.tie_free_ids(300, seed=62)
    fp8, _ = prefill_rows(tiny, stepper, tokens, [300], kv_cache_dtype="fp8")
    plain, _ = prefill_rows(tiny, stepper, tokens, [300])
    scale = plain.abs().max()
    per_position = (fp8 - plain).abs().amax(-1)
    assert per_position.median() <= 0.05 * scale
    assert (fp8.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.85
    assert per_position.max() > 0, "FP8 must change something"


def test_chunked_is_whole_under_fp8(tiny, h, stepper):
    tokens = tiny.tie_free_ids(300, seed=63)
    whole, _ = prefill_rows(tiny, stepper, tokens, [300], kv_cache_dtype="fp8")
    chunked, _ = prefill_rows(tiny, stepper, tokens, [37, 100, 1, 1, 3, 158], kv_cache_dtype="fp8")
    h.assert_rows_close(chunked, whole, range(300), "fp8 chunked vs whole")


def test_greedy_tokens_chunked_equal_whole_under_fp8(tiny):
    prompt = tiny.tie_free_ids(200, seed=64)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for chunk in (512, 48):
        eng = tiny.engine(kv_cache_dtype="fp8", max_num_batched_tokens=chunk, max_num_seqs=2, num_pages=8)
        eng.add_request("r", prompt, params)
        while eng.has_unfinished():
            done = [o for o in eng.step() if o.finished]
            if done:
                outs.append(done[0].token_ids)
    assert len(outs) == 2 and len(outs[0]) == 24 and outs[0] == outs[1]


def test_fp8_prefix_hits_equal_a_cold_fp8_engine(tiny, h, forcer):
    """A 1000-token request prefilled in chunks of 256 leaves checkpoints at 256, 512 and 768
    (byte buffers: packed SWA rows, model-dtype ring rows); requests of the same tokens resume
    at each and decode forced tokens: every logits row equals a cold FP8 engine's."""
    tokens = tiny.tie_free_ids(1000, seed=241)
    eng = tiny.engine(kv_cache_dtype="fp8", max_num_batched_tokens=256, max_num_seqs=8, num_pages=40)
    assert eng.runner.storage.checkpoints.dtype == torch.uint8 and "packed FP8" in eng.memory_report()
    forcer.run(eng, [h.Forced("first", tokens, all_logits=False)])
    cold_eng = tiny.engine(kv_cache_dtype="fp8", max_num_batched_tokens=2048, max_num_seqs=2, num_pages=8,
                           enable_prefix_caching=False)
    _, cold = forcer.run(cold_eng, [h.Forced("cold", tokens[:900])]).rows("cold")
    specs = [h.Forced(f"at{L}", tokens[:L + 37], tokens[L + 37:L + 57], all_logits=False) for L in (256, 512, 768)]
    run = forcer.run(eng, specs)
    for spec, L in zip(specs, (256, 512, 768)):
        assert next(start for step in run.steps for r, start, _ in step if r == spec.rid) == L
        positions, rows = run.rows(spec.rid)
        h.assert_rows_close(rows, cold[positions], positions, f"{spec.rid} vs cold")
    h.assert_cache_accounting(eng)
