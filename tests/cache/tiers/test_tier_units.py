"""Units of the tiers (dsv4/cache/tiers/): chain keys, the group file format's checks, a page
row round trip, the host pools' eviction rules, run coalescing, and the flags' errors."""
from __future__ import annotations

import pytest
import torch

from dsv4.cache.layout import CacheLayout, CachePlan
from dsv4.cache.storage import KVStorage
from dsv4.cache.tiers.codec import PageCodec
from dsv4.cache.tiers.files import Corrupt, SignatureMismatch, encode, read_group, read_group_into, read_header
from dsv4.cache.tiers.host import Pool
from dsv4.cache.tiers.keys import chain_keys, root_key
from dsv4.cache.tiers.movers import runs
from dsv4.config import ConfigError, EngineConfig
from dsv4.model.random_init import preset_config


def test_chain_keys_name_whole_prefixes():
    root = root_key("sig")
    a = list(range(1000))
    b = a[:5] + [7] + a[6:]
    ka, kb = chain_keys(root, a, 3), chain_keys(root, b, 3)
    assert ka[0] != kb[0] and ka[1] != kb[1] and ka[2] != kb[2]      # a change in page 0 changes every key after
    assert chain_keys(root, a[:512], 2) == ka[:2]
    assert chain_keys(root_key("other"), a, 1) != ka[:1]
    with pytest.raises(ValueError):
        chain_keys(root, a[:300], 2)


def test_group_file_round_trip_and_refusals(tmp_path):
    pages, tail = torch.randn(3, 10).bfloat16(), torch.randn(7).bfloat16()
    blob = encode("sig", "", ["aa", "bb", "cc"], pages, tail)
    path = tmp_path / "g.kv"
    path.write_bytes(blob)
    head, got_pages, got_tail = read_group(str(path), "sig")
    assert head.keys == ("aa", "bb", "cc") and torch.equal(got_pages, pages) and torch.equal(got_tail, tail)
    assert got_pages.dtype == torch.bfloat16
    path.write_bytes(encode("sig", "", ["aa", "bb", "cc"], pages, None))
    assert read_group(str(path), "sig")[2] is None
    with pytest.raises(SignatureMismatch):
        read_group(str(path), "other")
    for bad in (blob[:-1], blob + b"x", blob[:-3] + bytes([blob[-3] ^ 1]) + blob[-2:], b"junk\n" + blob, b""):
        path.write_bytes(bad)
        with pytest.raises(Corrupt):
            read_group(str(path), "sig")


def test_group_read_into_rows_skips_and_refuses(tmp_path):
    """A group is read straight into given rows (None: a page the host holds already, read and
    dropped); a file changed since it was indexed, or damaged, is refused (Corrupt)."""
    pages, tail = torch.randn(3, 10), torch.randn(7)
    path = tmp_path / "g.kv"
    path.write_bytes(encode("sig", "", ["aa", "bb", "cc"], pages, tail))
    head, _ = read_header(str(path))
    rows, tail_row = torch.zeros(3, 10), torch.zeros(7)
    moved = read_group_into(str(path), head, [rows[0], None, rows[2]], tail_row)
    assert moved == (2 * 10 + 7) * 4
    assert torch.equal(rows[[0, 2]], pages[[0, 2]]) and not rows[1].any() and torch.equal(tail_row, tail)
    with pytest.raises(Corrupt):                                    # rows of another size
        read_group_into(str(path), head, [torch.zeros(9), None, None], tail_row)
    path.write_bytes(encode("sig", "", ["aa", "bb", "dd"], pages, tail))
    with pytest.raises(Corrupt):                                    # not the file the index knows
        read_group_into(str(path), head, [None] * 3, tail_row)
    blob = encode("sig", "", ["aa", "bb", "cc"], pages, tail)
    path.write_bytes(blob[:-3] + bytes([blob[-3] ^ 1]) + blob[-2:])
    with pytest.raises(Corrupt):                                    # checksum
        read_group_into(str(path), head, [None] * 3, tail_row)


def test_page_codec_round_trip():
    layout = CacheLayout(preset_config("tiny"))
    st = KVStorage(layout, CachePlan(num_pages=6, num_swa_pages=4, max_num_seqs=1), torch.float32, "cpu")
    for t in st.kinds.values():
        t.copy_(torch.randn(t.shape))
    codec = PageCodec(st)
    rows = torch.empty(2, codec.numel)
    codec.gather(torch.tensor([2, 4]), rows)
    before = {k: t.clone() for k, t in st.kinds.items()}
    codec.scatter(rows, torch.tensor([0, 5]))
    for kind in ("c4", "idx", "c128"):
        assert torch.equal(st.page(kind, 0), before[kind][2]) and torch.equal(st.page(kind, 5), before[kind][4])
        assert torch.equal(st.kinds[kind][1:5], before[kind][1:5])
    with pytest.raises(ValueError):
        codec.gather(torch.tensor([1]), rows)


def test_host_pool_evicts_only_ready_unreferenced_entries_lru_first():
    pool = Pool(torch.empty(2, 4))
    a = pool.reserve(b"a")
    assert pool.reserve(b"b") is not None and pool.reserve(b"c") is None      # both held by their writers
    a.ready, a.refs = True, 0
    pool.index[b"b"].ready, pool.index[b"b"].refs = True, 0
    pool.touch([b"a"])                                                           # b is now the oldest
    assert pool.reserve(b"c") is not None and b"b" not in pool.index and b"a" in pool.index
    pool.acquire([b"a"])
    assert pool.reserve(b"d") is None                                            # a referenced, c not ready
    pool.release([b"a"])
    with pytest.raises(ValueError):
        pool.release([b"a"])


def test_host_pool_evicts_leaves_before_their_parents():
    """A chain root -> mid -> leaf stored in that order (root the oldest) loses its leaf first;
    the entries with children passed on the way become the newest; a parent named in `spare`
    is not taken for its child."""
    pool = Pool(torch.empty(4, 4))
    for key, parent in ((b"root", None), (b"mid", b"root"), (b"leaf", b"mid"), (b"other", None)):
        e = pool.reserve(key, parent)
        e.ready, e.refs = True, 0
    assert pool.reserve(b"x") is not None                   # root and mid have children: leaf goes
    assert b"leaf" not in pool.index and list(pool.index) == [b"other", b"root", b"mid", b"x"]
    pool.index[b"x"].ready, pool.index[b"x"].refs = True, 0
    assert pool.reserve(b"y") is not None and b"other" not in pool.index
    pool.index[b"y"].ready, pool.index[b"y"].refs = True, 0
    assert pool.reserve(b"z", b"mid", spare={b"mid"}) is not None
    assert b"mid" in pool.index and b"x" not in pool.index  # mid (now a leaf) spared
    assert pool.index[b"mid"].children == 1 and pool.index[b"root"].children == 1


def test_runs_coalesce_consecutive_slots():
    assert runs([4, 5, 6, 2, 3, 9]) == [(0, 4, 3), (3, 2, 2), (5, 9, 1)]
    assert runs([4, 5, 6, 7, 8, 2], limit=2) == [(0, 4, 2), (2, 6, 2), (4, 8, 1), (5, 2, 1)]
    assert runs([]) == []


@pytest.mark.parametrize("fields, name", [({"host_cache_gb": -1}, "host_cache_gb"),
                                          ({"disk_cache_dir": "/tmp/x"}, "disk_cache_dir"),
                                          ({"host_cache_gb": 1, "disk_cache_dir": "/tmp/x", "disk_cache_gb": 0},
                                           "disk_cache_gb"),
                                          ({"host_cache_gb": 1, "enable_prefix_caching": False}, "host_cache_gb")])
def test_bad_tier_settings_name_their_field(fields, name):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**fields)
    assert e.value.field == name
