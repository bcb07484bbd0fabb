"""The resume unit (dsv4/cache/checkpoint.py): which rows a checkpoint at L holds, pack/unpack
between two requests' pages and slots, the flat buffer's bytes and the layout signature."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4.cache.checkpoint import (CheckpointFormat, CheckpointMismatch, CheckpointUnit, from_bytes,
                                   layout_signature, to_bytes)
from dsv4.cache.layout import SWA_PAGE_TOKENS, CacheLayout, CachePlan
from dsv4.cache.storage import KVStorage
from dsv4.model.random_init import preset_config


def storage_of(window: int, spec_slots: int = 0) -> KVStorage:
    layout = CacheLayout(preset_config("tiny", sliding_window=window), spec_slots=spec_slots)
    st = KVStorage(layout, CachePlan(num_pages=4, num_swa_pages=12, max_num_seqs=3, num_checkpoints=2),
                   torch.float32, "cpu")
    gen = torch.Generator().manual_seed(window + spec_slots)
    for t in st.kinds.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    return st


def swa_row(st: KVStorage, table: list[int], pos: int) -> int:
    """The row of `pos` in every layer's SWA view, as cache/addressing.py writes it."""
    return table[pos // SWA_PAGE_TOKENS] * st.layout.swa_pitch + pos % SWA_PAGE_TOKENS


def ring_row(st: KVStorage, slot: int, pos: int) -> int:
    return slot * st.layout.csa_ring_pitch + pos % st.layout.csa_ring


@pytest.mark.parametrize("window, spec_slots, L", [(32, 0, 256), (128, 0, 512), (128, 3, 256), (77, 2, 768)])
def test_pack_then_unpack_moves_exactly_the_rows_of_a_resume(window, spec_slots, L):
    """Pack a checkpoint at L from request A (its SWA pages and slot), unpack it into request B
    (other pages, other slot): in every layer's view (the rows the model reads), B's SWA keys of
    [L - W, L) and its CSA compressor / indexer ring rows of [L - 4, L) equal A's; every other
    row of the storage is unchanged."""
    st = storage_of(window, spec_slots)
    fmt = st.checkpoint_format
    a_table = [-1] * (L // SWA_PAGE_TOKENS - 2) + [3, 7]            # A holds only the pages near L
    b_table = [-1] * (L // SWA_PAGE_TOKENS - 2) + [10, 1]
    before = {k: t.clone() for k, t in st.kinds.items()}
    fmt.pack(st, a_table, 2, L, st.checkpoints[1])
    assert torch.equal(st.kinds["swa"], before["swa"]), "pack wrote to the cache"
    fmt.unpack(st, st.checkpoints[1], b_table, 0, L)

    changed = {k: (t != before[k]).any(dim=-1).nonzero().tolist() for k, t in st.kinds.items()}
    for i, lkv in enumerate(st.layers):
        for p in range(L - window, L):
            assert torch.equal(lkv.swa[swa_row(st, b_table, p)], lkv.swa[swa_row(st, a_table, p)]), (i, p)
        for name in ("ring_kv", "ring_gate", "iring_kv", "iring_gate"):
            view = getattr(lkv, name)
            if view is None or i not in st.layout.csa_layers:
                continue
            for p in range(L - 4, L):
                assert torch.equal(view[ring_row(st, 0, p)], view[ring_row(st, 2, p)]), (i, name, p)
    n_swa = st.layout.num_swa_layers * window
    assert len(changed["swa"]) == n_swa and all(u in (10, 1) for u, _, _ in changed["swa"])
    for name in ("ring_kv", "ring_gate", "iring_kv", "iring_gate"):
        assert len(changed[name]) == len(st.layout.csa_layers) * 4 and {u for u, _, _ in changed[name]} == {0}
    assert not any(changed[k] for k in ("c4", "idx", "c128", "hring_kv", "hring_gate")), "HCA / history touched"


def test_flat_buffer_size_and_bytes_round_trip():
    st = storage_of(32)
    fmt = st.checkpoint_format
    lay, c = st.layout, st.layout.cfg
    csa = len(lay.csa_layers)
    assert fmt.numel == lay.num_swa_layers * 32 * c.head_dim + csa * 4 * 2 * (2 * c.head_dim + 2 * c.index_head_dim)
    fmt.pack(st, [4, 5, 6], 1, 256, st.checkpoints[0])
    unit = fmt.unit(st.checkpoints[0], 256)
    back = from_bytes(to_bytes(unit))
    assert back.signature == fmt.signature and back.position == 256
    assert torch.equal(fmt.check(back), st.checkpoints[0])


def test_a_unit_of_another_layout_is_refused():
    st = storage_of(32)
    fmt = st.checkpoint_format
    unit = fmt.unit(st.checkpoints[0], 256)
    other = CheckpointFormat(CacheLayout(preset_config("tiny", sliding_window=32, index_topk=8)), torch.float32)
    with pytest.raises(CheckpointMismatch, match="another model config"):
        other.check(unit)
    with pytest.raises(CheckpointMismatch, match="checkpoint data"):
        fmt.check(CheckpointUnit(fmt.signature, 256, unit.data[:-1]))
    with pytest.raises(CheckpointMismatch, match="checkpoint data"):
        fmt.check(CheckpointUnit(fmt.signature, 256, unit.data.double()))
    blob = to_bytes(unit)
    with pytest.raises(CheckpointMismatch, match="truncated"):
        from_bytes(blob[:-8])
    with pytest.raises(CheckpointMismatch, match="not a checkpoint"):
        from_bytes(b"garbage\n1234")


def test_signature_covers_every_compared_config_field_and_the_dtypes():
    """Every field ModelConfig compares (fields added later included) changes the signature, and
    so do the weight and KV dtypes and the layers holding SWA keys; equal configs agree."""
    cfg = preset_config("tiny")
    base = layout_signature(CacheLayout(cfg), torch.float32, torch.float32)
    assert base == layout_signature(CacheLayout(preset_config("tiny")), torch.float32, torch.float32)
    fields = [f.name for f in dataclasses.fields(cfg) if f.compare]
    assert "index_topk" in fields and "sliding_window" in fields
    for name in fields:
        changed = dataclasses.replace(cfg, **{name: _other(cfg, name)})
        assert layout_signature(CacheLayout(changed), torch.float32, torch.float32) != base, name
    assert layout_signature(CacheLayout(cfg), torch.bfloat16, torch.float32) != base
    assert layout_signature(CacheLayout(cfg), torch.float32, torch.bfloat16) != base
    assert layout_signature(CacheLayout(cfg, with_mtp=True), torch.float32, torch.float32) != base
    assert layout_signature(CacheLayout(cfg, spec_slots=3), torch.float32, torch.float32) == base, \
        "rows are stored by position: the speculative slots do not change the unit"


def _other(cfg, name: str):
    """Another valid value of the config field `name`."""
    value = getattr(cfg, name)
    if name == "index_topk_pattern":          # IndexCache's producer set: the unit depends on it
        return "F" + "S" * (cfg.num_csa_layers - 1)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return f"changed-{name}"


def test_positions_must_be_page_boundaries_and_rows_held():
    st = storage_of(32)
    fmt = st.checkpoint_format
    with pytest.raises(ValueError, match="not a positive multiple of 256"):
        fmt.pack(st, [0, 1, 2], 0, 200, st.checkpoints[0])
    with pytest.raises(RuntimeError, match="SWA page of positions"):
        fmt.pack(st, [0, -1, 2], 0, 256, st.checkpoints[0])
    with pytest.raises(ValueError, match="checkpoint buffer of shape"):
        fmt.pack(st, [0, 1, 2], 0, 256, st.checkpoints[0][:-1])
