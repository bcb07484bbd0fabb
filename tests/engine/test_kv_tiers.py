"""Invariant 5 through the host and disk tiers (docs/architecture.md, "Host and disk tiers"): a
request whose prefix is restored from host memory or from disk (the GPU prefix cache emptied, or
a new engine on the same disk folder) gives the logits of a cold engine (fp32 tolerance) and the
same greedy tokens, for prompts ending on a page boundary and past one; usage counts the
restored tokens as cached; prompt-logprobs requests never load."""
from __future__ import annotations

import pytest

from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
HOST_GB = 0.02


def cold_rows(tiny, h, forcer, tokens):
    eng = tiny.engine(max_num_batched_tokens=2048, max_num_seqs=2, num_pages=8, enable_prefix_caching=False)
    _, rows = forcer.run(eng, [h.Forced("cold", tokens)]).rows("cold")
    return rows


def first_start(run, rid):
    return next(start for step in run.steps for r, start, _ in step if r == rid)


def greedy(h, eng, rid, prompt, n=12):
    """Greedy tokens of one request and how many of its prompt tokens were cached."""
    out = h.drive_greedy(eng, {rid: prompt}, n)[rid]
    return out.token_ids, out.num_cached_tokens


def check_resumed(tiny, h, forcer, eng, tokens, prompt_len, expect_start, rid):
    run = forcer.run(eng, [h.Forced(rid, tokens[:prompt_len], tokens[prompt_len:prompt_len + 20],
                                    all_logits=False)])
    assert first_start(run, rid) == expect_start, f"{rid} did not resume at {expect_start}"
    positions, rows = run.rows(rid)
    assert positions == list(range(prompt_len - 1, prompt_len + 20))
    h.assert_rows_close(rows, cold_rows(tiny, h, forcer, tokens[:prompt_len + 20])[positions], positions,
                        f"{rid} vs cold")


@pytest.mark.parametrize("prompt_len, start", [(700, 512), (768, 512), (513, 512)])
def test_restored_from_host_matches_cold(tiny, h, forcer, prompt_len, start):
    """A first request leaves checkpoints at 256, 512 (and 768); the GPU prefix cache is emptied;
    the same prompt resumes from the host tier at its deepest checkpoint before the last token."""
    tokens = tiny.tie_free_ids(1000, seed=401)
    eng = tiny.engine(max_num_batched_tokens=256, max_num_seqs=4, num_pages=40, host_cache_gb=HOST_GB)
    forcer.run(eng, [h.Forced("first", tokens[:900], all_logits=False)])
    eng.reset_prefix_cache()
    assert eng.cache.prefix.num_pages == 0
    check_resumed(tiny, h, forcer, eng, tokens, prompt_len, start, "again")
    assert eng.cache.tiers.stats.hit_tokens["host"] == start
    h.assert_cache_accounting(eng)
    eng.reset_prefix_cache()
    got, cached = greedy(h, eng, "greedy", tokens[:prompt_len])
    cold, _ = greedy(h, tiny.engine(max_num_batched_tokens=2048, max_num_seqs=2, num_pages=8,
                                 enable_prefix_caching=False), "greedy", tokens[:prompt_len])
    assert got == cold and cached == start


def test_restore_deeper_than_the_gpu_hit_reuses_the_gpu_pages(tiny, h, forcer):
    """The GPU keeps the pages of [0, 512) but its checkpoint at 768 is dropped: the host supplies
    only the missing page and the tail; the result matches the cold engine."""
    tokens = tiny.tie_free_ids(1000, seed=402)
    eng = tiny.engine(max_num_batched_tokens=256, max_num_seqs=4, num_pages=40, host_cache_gb=HOST_GB)
    forcer.run(eng, [h.Forced("first", tokens[:900], all_logits=False)])
    tree = eng.cache.prefix
    deep = [n for n in tree._lru if n.depth == 3][0]
    tree.drop_checkpoint(deep)
    assert tree.num_pages == 2
    check_resumed(tiny, h, forcer, eng, tokens, 800, 768, "deeper")
    assert eng.cache.tiers.stats.hit_tokens["host"] == 768 - 512
    h.assert_cache_accounting(eng)


def test_restored_from_disk_after_a_restart_matches_cold(tiny, h, forcer, tmp_path):
    """An engine writes its prefixes to disk; a new engine on the same folder (a restart: empty
    GPU and host tiers) resumes the prompt from disk; logits equal the cold engine's, greedy
    tokens equal, usage counts the restored tokens."""
    tokens = tiny.tie_free_ids(1000, seed=403)
    cfg = dict(max_num_batched_tokens=256, max_num_seqs=4, num_pages=40, host_cache_gb=HOST_GB,
               disk_cache_dir=str(tmp_path), disk_cache_gb=1)
    eng = tiny.engine(**cfg)
    forcer.run(eng, [h.Forced("first", tokens[:900], all_logits=False)])
    eng.cache.tiers.close()
    assert eng.cache.tiers.disk.files
    for prompt_len, start in ((700, 512), (512, 256)):
        check_resumed(tiny, h, forcer, tiny.engine(**cfg), tokens, prompt_len, start, f"disk{prompt_len}")
    restarted = tiny.engine(**cfg)
    got, cached = greedy(h, restarted, "g", tokens[:700])
    cold, cold_cached = greedy(h, tiny.engine(**{**cfg, "host_cache_gb": 0, "disk_cache_dir": None}), "g", tokens[:700])
    assert got == cold and cached == 512 and cold_cached == 0
    assert restarted.cache.tiers.stats.hit_tokens["disk"] == 512


def test_prompt_logprobs_requests_skip_tier_loads(tiny, h, forcer):
    tokens = tiny.tie_free_ids(800, seed=404)
    eng = tiny.engine(max_num_batched_tokens=256, max_num_seqs=4, num_pages=40, host_cache_gb=HOST_GB)
    forcer.run(eng, [h.Forced("first", tokens[:700], all_logits=False)])
    eng.reset_prefix_cache()
    run = forcer.run(eng, [h.Forced("lp", tokens[:700], tokens[700:705], all_logits=True)])
    assert first_start(run, "lp") == 0
    assert eng.cache.tiers.stats.hit_tokens["host"] == 0


def test_tier_metrics_reach_prometheus(tiny, h, forcer):
    """Hits by tier (tokens), bytes each way, latency histograms and occupancy in /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    from dsv4.engine.core import EngineCore
    from dsv4.engine.ipc import AddRequest
    from dsv4.serve.http.metrics import ServerMetrics
    tokens = tiny.tie_free_ids(800, seed=405)
    eng = tiny.engine(max_num_batched_tokens=256, max_num_seqs=4, num_pages=40, host_cache_gb=HOST_GB)
    core, metrics = EngineCore(eng), ServerMetrics("m", eng.plan.num_pages)

    def run(rid):
        core.handle(AddRequest(rid, tokens[:700], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
        while core.has_work:
            core.step()
            metrics.update(core.stats())
    run("a")
    run("b")                      # a GPU hit at 512
    eng.reset_prefix_cache()
    run("c")                      # a host hit at 512
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    hits = {dict(k[1])["tier"]: v for k, v in got.items() if k[0] == "dsv4:prefix_cache_tier_hits_total"}
    assert hits == {"gpu": 512, "host": 512, "disk": 0}
    tiers = eng.cache.tiers
    page, tail = tiers.page_bytes, tiers.tail_bytes
    moved = {dict(k[1])["direction"]: v for k, v in got.items() if k[0] == "dsv4:kv_tier_bytes_total"}
    assert moved["gpu_to_host"] == 2 * page + 2 * tail and moved["host_to_gpu"] == 2 * page + tail
    counts = {dict(k[1])["op"]: v for k, v in got.items() if k[0] == "dsv4:kv_tier_latency_seconds_count"}
    assert counts["host_store"] == 2 and counts["host_load"] == 1
    usage = {dict(k[1])["what"]: v for k, v in got.items() if k[0] == "dsv4:kv_tier_usage"}
    assert usage["host_pages_used"] == 2 and usage["host_tails_used"] == 2
