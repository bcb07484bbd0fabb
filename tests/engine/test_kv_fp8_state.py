"""Packed FP8 KV (`--kv-cache-dtype fp8`) through everything that moves a request's state
outside its own pages (docs/architecture.md, "Cache"): the host and disk tiers (checkpoint
units of bytes: packed SWA rows, model-dtype ring rows) and the prefill/decode hand-off (the
state's packed history pages and continuation rows). Each restored or handed-off request gives
the greedy tokens of a plain FP8 engine (invariant 5); an FP8 state is refused by a model-dtype
engine (the layout signature names the KV dtype)."""
from __future__ import annotations

import pytest
import torch

from dsv4.cache.checkpoint import CheckpointMismatch, from_bytes, to_bytes
from dsv4.disagg.state import StateCodec, StateMismatch
from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
FP8 = dict(kv_cache_dtype="fp8", max_num_batched_tokens=256, max_num_seqs=4, num_pages=40)


def greedy(h, eng, rid, prompt, n=12):
    out = h.drive_greedy(eng, {rid: prompt}, n)[rid]
    return out.token_ids, out.num_cached_tokens


def test_fp8_prefix_restored_from_host_and_from_disk_equals_plain(tiny, h, tmp_path):
    tokens = tiny.tie_free_ids(900, seed=431)
    cfg = dict(FP8, host_cache_gb=0.02, disk_cache_dir=str(tmp_path), disk_cache_gb=1)
    plain, _ = greedy(h, tiny.engine(**{**FP8, "enable_prefix_caching": False}), "p", tokens[:700])
    eng = tiny.engine(**cfg)
    greedy(h, eng, "first", tokens)
    eng.reset_prefix_cache()
    got, cached = greedy(h, eng, "host", tokens[:700])
    assert got == plain and cached == 512 and eng.cache.tiers.stats.hit_tokens["host"] == 512
    h.assert_cache_accounting(eng)
    eng.cache.tiers.close()
    restarted = tiny.engine(**cfg)
    got, cached = greedy(h, restarted, "disk", tokens[:700])
    assert got == plain and cached == 512 and restarted.cache.tiers.stats.hit_tokens["disk"] == 512


def test_fp8_checkpoint_units_are_bytes_and_refused_by_a_model_dtype_cache(tiny, h):
    eng = tiny.engine(**FP8)
    greedy(h, eng, "first", tiny.tie_free_ids(600, seed=432))
    fmt, storage = eng.runner.storage.checkpoint_format, eng.runner.storage
    row = next(n.checkpoint for n in eng.cache.prefix._lru if n.checkpoint is not None)
    unit = from_bytes(to_bytes(fmt.unit(storage.checkpoints[row], 256)))
    assert unit.data.dtype == torch.uint8 and torch.equal(fmt.check(unit), storage.checkpoints[row])
    other = tiny.engine(max_num_batched_tokens=256, max_num_seqs=4, num_pages=40).runner.storage.checkpoint_format
    with pytest.raises(CheckpointMismatch):
        other.check(unit)


def test_fp8_state_hand_off_equals_plain_and_is_refused_by_model_dtype(tiny, h):
    from dsv4.disagg.handoff import Exporter, Importer
    cfg = dict(FP8, max_num_batched_tokens=128, num_pages=12)
    prefill, decode, plain = tiny.engine(**cfg), tiny.engine(**cfg), tiny.engine(**cfg)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for length in (7, 131, 258, 388):
        ids = tiny.ids(length, seed=length)
        want = h.drive_greedy(plain, {f"p{length}": ids}, 6)[f"p{length}"].token_ids
        importer, exporter = Importer(decode), (prefill.scheduler.on_finish.__self__ if prefill.scheduler.on_finish
                                                else Exporter(prefill))
        req = importer.begin(f"r{length}", ids, params)
        exporter.wanted[f"r{length}"] = importer.reserve(req)
        h.drive_greedy(prefill, {f"r{length}": ids[:-1]}, 1)
        header, data = exporter.ready.pop(f"r{length}")
        importer.finish(req, header, data)
        got = {}
        while decode.has_unfinished():
            got.update((o.request_id, o.token_ids) for o in decode.step())
        assert got[f"r{length}"] == want, length
    bf = StateCodec(tiny.engine(max_num_batched_tokens=128, max_num_seqs=4, num_pages=12).runner.storage)
    with pytest.raises(StateMismatch):
        bf.check(header)
