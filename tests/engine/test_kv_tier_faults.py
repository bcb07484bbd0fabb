"""Faults of the disk tier (docs/architecture.md, "Host and disk tiers"): a full disk (an injected
write error), a file truncated or bit-flipped between runs, files of another layout signature,
a process killed while writing (its temporary file left behind). In every case nothing wrong is
loaded (the request's logits equal a cold engine's), serving continues, and the tier heals: the
damaged groups are written again and a later restart resumes from them."""
from __future__ import annotations

import errno
import os

import pytest

from dsv4.cache.tiers import disk as disk_module

pytestmark = pytest.mark.usefixtures("one_thread")
HOST_GB = 0.02


def config(tmp_path, **more):
    return dict(max_num_batched_tokens=256, max_num_seqs=4, num_pages=40, host_cache_gb=HOST_GB,
                disk_cache_dir=str(tmp_path), disk_cache_gb=1, **more)


def files(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path))


def prime(tiny, h, forcer, cfg, tokens):
    """One request of 900 tokens: groups ending at 256, 512 and 768 written to disk."""
    eng = tiny.engine(**cfg)
    forcer.run(eng, [h.Forced("first", tokens[:900], all_logits=False)])
    eng.cache.tiers.close()
    return eng


def cold_rows(tiny, h, forcer, tokens):
    eng = tiny.engine(max_num_batched_tokens=2048, max_num_seqs=2, num_pages=8, enable_prefix_caching=False)
    _, rows = forcer.run(eng, [h.Forced("cold", tokens)]).rows("cold")
    return rows


def resume(tiny, h, forcer, eng, tokens, rid, prompt_len=800):
    """Run tokens[:prompt_len] + 10 forced tokens; check every logits row against the cold
    engine; return where its first chunk started."""
    run = forcer.run(eng, [h.Forced(rid, tokens[:prompt_len], tokens[prompt_len:prompt_len + 10],
                                    all_logits=False)])
    positions, rows = run.rows(rid)
    h.assert_rows_close(rows, cold_rows(tiny, h, forcer, tokens[:prompt_len + 10])[positions], positions, rid)
    eng.cache.tiers.close()
    return next(start for step in run.steps for r, start, _ in step if r == rid)


def group_files(tmp_path) -> list[str]:
    """The group files, in chain order (each one's parent before it)."""
    names = [n for n in files(tmp_path) if n.endswith(".kv")]
    chain = {}
    for n in names:
        head, _ = disk_module.read_header(os.path.join(tmp_path, n))
        chain[head.parent] = n
    out, parent = [], ""
    while parent in chain:
        out.append(chain[parent])
        parent = disk_module.read_header(os.path.join(tmp_path, chain[parent]))[0].keys[-1]
    return out


def test_disk_full_then_heals(tiny, h, forcer, tmp_path, monkeypatch):
    tokens = tiny.tie_free_ids(1000, seed=501)

    def full(path, parts):
        with open(path, "wb") as f:
            f.write(parts[0])                       # the header, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(disk_module, "write_file", full)
    eng = prime(tiny, h, forcer, config(tmp_path), tokens)
    assert files(tmp_path) == [] and eng.cache.tiers.stats.disk_write_errors == 3
    assert resume(tiny, h, forcer, eng, tokens, "gpu") == 768             # serving continues (a GPU hit)
    monkeypatch.undo()
    eng.reset_prefix_cache()
    assert resume(tiny, h, forcer, eng, tokens, "host") == 768            # its restore writes the prefix again
    assert len(group_files(tmp_path)) == 1                                # one group: pages [0, 768), the tail
    assert resume(tiny, h, forcer, tiny.engine(**config(tmp_path)), tokens, "restart") == 768


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "killed"])
def test_damaged_file_is_never_loaded_and_heals(tiny, h, forcer, tmp_path, damage):
    """The middle group (pages of [256, 512) and the checkpoint at 512) is damaged between runs:
    the restarted engine resumes at 256 (the last sound group), never from the damaged one or
    the group after it; its own commits write them again; the next restart resumes at 768."""
    tokens = tiny.tie_free_ids(1000, seed=506)     # tie-free at the first draw (502 took 8)
    prime(tiny, h, forcer, config(tmp_path), tokens)
    first, middle, last = group_files(tmp_path)      # a file per commit: groups ending at 256, 512, 768
    path = os.path.join(tmp_path, middle)
    blob = open(path, "rb").read()
    if damage == "truncate":
        open(path, "wb").write(blob[:-100])
    elif damage == "bitflip":
        flipped = bytearray(blob)
        flipped[-5] ^= 0x10
        open(path, "wb").write(bytes(flipped))
    else:          # killed while writing `middle`: only its temporary file is there
        os.remove(path)
        os.remove(os.path.join(tmp_path, last))
        open(os.path.join(tmp_path, f"{disk_module.TMP}4242-{middle}"), "wb").write(blob[:len(blob) // 3])
    eng = tiny.engine(**config(tmp_path))
    assert resume(tiny, h, forcer, eng, tokens, "after") == 256
    assert eng.cache.tiers.stats.hit_tokens["disk"] == 256
    assert eng.cache.tiers.stats.disk_bad_files >= 1
    assert group_files(tmp_path)[0] == first and not [n for n in files(tmp_path) if n.startswith(".tmp")]
    assert resume(tiny, h, forcer, tiny.engine(**config(tmp_path)), tokens, "healed") == 768


def test_other_signature_is_ignored(tiny, tiny_w128, h, forcer, tmp_path):
    """Groups written by a model with another window (another checkpoint layout signature) are
    never loaded nor deleted; the engine computes the prompt cold and writes its own."""
    tokens = tiny.tie_free_ids(1000, seed=503)
    prime(tiny_w128, h, forcer, config(tmp_path), tokens)
    foreign = files(tmp_path)
    eng = tiny.engine(**config(tmp_path))
    assert eng.cache.tiers.stats.disk_bad_files == 3 and not eng.cache.tiers.disk.files
    assert resume(tiny, h, forcer, eng, tokens, "cold") == 0
    assert set(foreign) < set(files(tmp_path)) and len(files(tmp_path)) == 6
    assert resume(tiny, h, forcer, tiny.engine(**config(tmp_path)), tokens, "own") == 768
