"""`dsv4 plan`: the cache figures are the bytes KVStorage actually allocates, and what fits is
said (or refused, naming the flag)."""
from __future__ import annotations

import pytest
import torch

from dsv4.cache.layout import CacheLayout, CachePlan
from dsv4.cache.sizing import cache_components, requests_that_fit
from dsv4.cache.storage import KVStorage
from dsv4.cli import main
from dsv4.model.random_init import preset_config


@pytest.mark.parametrize("spec_slots, dtype", [(0, torch.float32), (3, torch.bfloat16)])
def test_planned_bytes_equal_the_allocated_tensors(spec_slots, dtype):
    layout = CacheLayout(preset_config("tiny", sliding_window=64), spec_slots=spec_slots, with_mtp=True)
    plan = CachePlan(num_pages=7, num_swa_pages=5, max_num_seqs=3)
    storage = KVStorage(layout, plan, dtype, "cpu")
    planned = cache_components(layout, plan, dtype)
    assert sum(planned.values()) == storage.nbytes() == sum(t.numel() * t.element_size() for t in storage.kinds.values())
    assert planned["sliding-window pages"] == storage.kinds["swa"].numel() * storage.kinds["swa"].element_size()
    assert planned["CSA indexer rings"] == sum(storage.kinds[k].numel() * storage.kinds[k].element_size()
                                               for k in ("iring_kv", "iring_gate"))


def test_requests_that_fit_are_bounded_by_pages_and_slots():
    plan = CachePlan(num_pages=10, num_swa_pages=4, max_num_seqs=3)
    assert requests_that_fit(plan, 256) == 3            # slots bound it
    assert requests_that_fit(plan, 1000) == 2           # 4 pages each
    assert requests_that_fit(plan, 2561) == 0


def test_cli_prints_every_component_and_what_fits(capsys):
    assert main(["plan", "--model", "random:tiny", "--num-pages", "8", "--request-tokens", "600"]) == 0
    out = capsys.readouterr().out
    for row in ("routed experts", "sliding-window pages", "C4 entries (CSA)", "indexer keys (CSA)",
                "C128 entries (HCA)", "HCA compressor rings", "total"):
        assert row in out, row
    assert "2048 tokens of history" in out and "2 request(s) of 600 tokens" in out


def test_cli_refuses_a_request_that_never_fits(capsys):
    with pytest.raises(SystemExit, match="--request-tokens: a request of 5000 tokens does not fit"):
        main(["plan", "--model", "random:tiny", "--num-pages", "4", "--request-tokens", "5000"])
    with pytest.raises(SystemExit, match="--model"):
        main(["plan", "--model", "/nonexistent/checkpoint"])


def test_fp8_planned_bytes_equal_the_allocated_tensors():
    layout = CacheLayout(preset_config("tiny"), kv_fp8=True)
    plan = CachePlan(num_pages=5, num_swa_pages=4, max_num_seqs=2)
    storage = KVStorage(layout, plan, torch.bfloat16, "cpu")
    assert sum(cache_components(layout, plan, torch.bfloat16).values()) == storage.nbytes()
    assert storage.kinds["swa"].dtype == storage.kinds["idx"].dtype == torch.uint8
    assert storage.kinds["c4"].shape[-1] == 88 and storage.kinds["idx"].shape[-1] == 36     # 48+32+1 -> 88; 32+4
    assert storage.kinds["ring_kv"].dtype == torch.bfloat16


@pytest.mark.parametrize("caching", [[], ["--no-enable-prefix-caching"]])
def test_cli_fp8_shows_the_capacity_gain(capsys, caching):
    """Like for like: both plans keep prefix-cache checkpoints (each of its own format), or neither."""
    args = ["plan", "--model", "random:flash-slice:6", "--dtype", "bfloat16", "--cache-memory-gb", "40",
            "--request-tokens", "1000000", *caching]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--kv-cache-dtype", "fp8"]) == 0
    fp8 = capsys.readouterr().out
    tokens = [int(out.split("fits: ")[1].split()[0]) for out in (plain, fp8)]
    assert tokens[1] >= 1.7 * tokens[0]                        # the target
    gain = float(fp8.split("FP8 KV: ")[1].split("x")[0])
    assert gain == pytest.approx(tokens[1] / tokens[0], rel=1e-2)
    assert "packed FP8" in fp8 and "FP8 KV:" not in plain
    assert ("prefix-cache checkpoints" in fp8) == (not caching)
    with pytest.raises(SystemExit, match="--kv-cache-dtype"):
        main(["plan", "--model", "random:tiny", "--kv-cache-dtype", "int4"])
