"""The plan's workspace (engine/workspace.py): its indexer term is the bytes the indexer's tiles
allocate, its graph buffers the bytes StepGraphs allocates, and where the cache is sized from
free memory the cache's budget is smaller by exactly the workspace's bytes (and, in `dsv4 plan`,
which loads nothing, the weights' bytes)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from dsv4.cache.addressing import Scratch, build_step, padded_leaf_shapes
from dsv4.cache.layout import CacheLayout
from dsv4.cache.sizing import cache_budget, plan_cache, reserves_workspace
from dsv4.cli import main
from dsv4.cli import plan as plan_cli
from dsv4.config import EngineConfig
from dsv4.engine import workspace as ws
from dsv4.engine.cuda_graphs import StepGraphs, graph_shapes, static_bytes, warmup_seqs
from dsv4.engine.upload import HostToDevice, leaf_tensors
from dsv4.model.random_init import preset_config
from dsv4.ops.triton import indexer as tri

GIB = 2**30


class _InOrder:
    """A stand-in for a CUDA stream (everything in order on the CPU)."""
    device = torch.device("cpu")

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def record_event(self):
        return None


class _Rows:
    """A stand-in for RowTopk (its kernels need a GPU or Triton's interpreter): the tiles it got."""
    def __init__(self, k):
        self.tiles = []

    def add(self, tile, e0):
        self.tiles.append((tuple(tile.shape), e0))

    def offsets(self):
        return torch.zeros(1)


def test_indexer_term_is_the_score_buffers_the_tiles_allocate(monkeypatch):
    """Two buffers [T, tile_width] beside the top-k: what _rows_topk_beside allocates for T
    tokens over E entries (several tiles) is score_bytes, and the workspace's indexer term."""
    monkeypatch.setattr(tri, "SCORE_TILE", 1 << 12)
    monkeypatch.setattr(tri, "ROWS_MIN", 1)           # (a prefill chunk of 16 tokens)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: _InOrder())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    monkeypatch.setattr(tri, "RowTopk", _Rows)
    T, k, E = 16, 8, 1000
    width = tri.tile_width(T, k)
    assert width < E                                               # several tiles: beside
    fp32 = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: (
        t := empty(*a, **kw), kw.get("dtype") == torch.float32 and fp32.append(t.numel() * 4))[0])
    tiles = [(e0, min(e0 + width, E)) for e0 in range(0, E, width)]
    scores = torch.randn(T, E)
    tri._rows_topk_beside(tiles, lambda e0, e1, out: out.copy_(scores[:, e0:e1]), k, _InOrder(), T, width)
    assert fp32[0] == tri.score_bytes(T, k, E, side_stream=True) == 2 * T * width * 4
    assert tri.score_bytes(T, k, E, side_stream=False) == T * width * 4          # in order: one tile
    assert tri.score_bytes(T, k, width // 2, side_stream=True) == T * (width // 2) * 4   # one tile
    cfg = preset_config("tiny")
    config = EngineConfig(device="cuda", max_num_batched_tokens=T, max_model_len=4 * E, enforce_eager=True)
    assert ws.workspace_components(cfg, config, torch.float32)[ws.INDEXER] == \
        tri.score_bytes(T, min(cfg.index_topk, E), E, side_stream=tri.OVERLAP_TOPK)


def test_indexer_term_at_a_2048_token_chunk_of_a_long_context():
    """V4's 512 top-k at 1M positions, T = 2048: two tiles of 2048 x 32768 fp32 = 512 MiB."""
    cfg = preset_config("tiny", index_topk=512, max_position_embeddings=1 << 20)
    config = EngineConfig(device="cuda", max_num_batched_tokens=2048, enforce_eager=True)
    assert ws.indexer_score_bytes(cfg, config, 2048, side_stream=True) == 512 * 2**20


def test_graph_static_buffers_are_what_step_graphs_allocate():
    """static_bytes (a closed form) is the buffer StepGraphs allocates for a shape's padded step,
    and padded_leaf_shapes the shapes of that step's tensors, for decode and verify shapes."""
    cfg = preset_config("tiny")
    layout = CacheLayout(cfg)
    graphs = StepGraphs.__new__(StepGraphs)
    graphs.buffers, graphs.h2d = {}, HostToDevice("cpu")
    scratch = Scratch(0, 0, 0)
    for q in (1, 3):
        for shape in graph_shapes(8, 6, 700, q, cfg.sliding_window)[::7]:
            padded = build_step(warmup_seqs(shape, scratch, 700), layout, 7, shape, scratch)
            leaves = leaf_tensors(padded)
            assert sorted(tuple(t.shape) for t in leaves) == sorted(padded_leaf_shapes(shape))
            assert {t.dtype for t in leaves} == {torch.int64}
            flat, _ = graphs._static(shape, padded, leaves)
            assert flat.numel() * flat.element_size() == static_bytes(shape)


def test_graphs_counted_only_where_captured():
    cfg = preset_config("tiny")
    base = dict(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=600, cuda_graph_max_bs=4)
    parts = {device: ws.workspace_components(cfg, EngineConfig(device=device, **base), torch.float32) for device in ("cpu", "cuda")}
    assert ws.GRAPHS not in parts["cpu"] and parts["cuda"][ws.GRAPHS] > 0
    eager = ws.workspace_components(cfg, EngineConfig(device="cuda", enforce_eager=True, **base), torch.float32)
    assert ws.GRAPHS not in eager
    # 64 tokens a step: every row may have logits (a prompt-logprobs chunk of the whole step)
    assert parts["cpu"][ws.ACTIVATIONS] == ws.step_bytes(cfg, torch.float32, 64, 64)


def test_logits_rows_bound_by_the_prompt_logprobs_limit():
    """One chunk of prompt-logprobs rows beside a row a sequence (k + 1 verifying k drafts), or
    every sequence verifying, whichever is more; never more than the step's tokens."""
    def rows(tokens, limit, k=0):
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        return ws.logits_rows(EngineConfig(max_num_batched_tokens=tokens, max_num_seqs=64,
                                           max_prompt_logprobs_tokens=limit, speculative_config=spec))
    assert rows(2048, 512) == 512 + 63
    assert rows(2048, 8, k=2) == 8 + 63 * 3
    assert rows(2048, 1, k=2) == 64 * 3
    assert rows(300, 512) == 300


def test_free_memory_budget_leaves_out_exactly_the_workspace(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GIB, 80 * GIB))
    free = EngineConfig(device="cuda", max_num_batched_tokens=256)
    given = EngineConfig(device="cuda", max_num_batched_tokens=256, cache_memory_gb=2.0)
    assert reserves_workspace(free) and not reserves_workspace(given)
    assert cache_budget(free, 0) == int(10 * GIB * 0.9)
    assert cache_budget(free, 0) - cache_budget(free, 123_456_789) == 123_456_789
    assert cache_budget(given, 123_456_789) == cache_budget(given, 0) == 2 * GIB
    assert not reserves_workspace(EngineConfig(max_num_batched_tokens=256))          # the CPU's 1 GiB: given
    layout = CacheLayout(preset_config("tiny"))
    budgets = []
    plan = layout.plan
    monkeypatch.setattr(CacheLayout, "plan", lambda self, budget, *a: budgets.append(budget) or plan(budget, *a))
    plan_cache(layout, free, torch.float32, 0)
    plan_cache(layout, free, torch.float32, 5 * GIB)
    assert budgets[0] - budgets[1] == 5 * GIB


def test_cli_prints_the_workspace_and_fits_after_it(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB, 80 * GIB))
    args = ["plan", "--model", "random:tiny", "--device", "cuda", "--max-num-batched-tokens", "256",
            "--max-model-len", "4096", "--max-num-seqs", "4", "--cuda-graph-max-bs", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "workspace (left out of free memory before the cache was sized):" in out
    for row in (ws.INDEXER, ws.ACTIVATIONS, ws.GRAPHS):
        assert row in out, row
    config = EngineConfig(device="cuda", max_num_batched_tokens=256, max_model_len=4096, max_num_seqs=4,
                          cuda_graph_max_bs=4)
    cfg = preset_config("tiny")
    layout = CacheLayout(cfg)
    workspace = sum(ws.workspace_components(cfg, config, torch.float32).values())
    weights = sum(plan_cli._weights(cfg, torch.float32, config).values())   # not loaded: left out too
    plan = plan_cache(layout, config, torch.float32, workspace + weights)
    assert f"fits: {plan.max_tokens} tokens" in out
    assert plan.max_tokens < plan_cache(layout, config, torch.float32, workspace).max_tokens
    assert main(args + ["--cache-memory-gb", "0.5"]) == 0
    assert "workspace (beside the cache: its size was given):" in capsys.readouterr().out
