"""The host tier's memory: pinned rows of history pages and checkpoint tails (docs/architecture.md,
"Host and disk tiers").

Two pools, allocated once: `page_rows` [pages, page_numel] (one 256-token history page a row)
and `tail_rows` [tails, tail_numel] (one checkpoint a row), both in the cache dtype, pinned when
CUDA is there. Each pool has an index key -> Entry, least recently used first.

Invariants (tests/cache/tiers/test_accounting.py checks them after random workloads):
  * every slot is either free (on its free list once) or held by exactly one entry;
  * an entry is readable only once `ready` (its copy finished); a new entry starts with one
    reference, its writer's;
  * an entry with references (a copy reading or writing it) is never evicted; eviction takes
    ready, unreferenced entries, least recently used first;
  * leaves go first: a page entry records its parent's (the chain's previous page, when the host
    held it at reserve) and counts its children; eviction skips an entry with children and
    moves it to the newest end (a lazy refresh), so a chain is never cut above an entry the
    host keeps, and using a chain refreshes only its deepest entry: no work per page of it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .keys import Key


@dataclass(eq=False)
class Entry:
    slot: int
    refs: int = 1
    ready: bool = False
    parent: "Entry | None" = None     # the chain's previous page's entry (page pools)
    children: int = 0                 # entries whose parent this is


class Pool:
    """One kind of row (pages or tails): slots, index, LRU."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows
        self.index: OrderedDict[Key, Entry] = OrderedDict()
        self.free = list(range(rows.shape[0] - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    def has(self, key: Key) -> bool:
        e = self.index.get(key)
        return e is not None and e.ready

    def row(self, key: Key) -> torch.Tensor:
        return self.rows[self.index[key].slot]

    def reserve(self, key: Key, parent: Key | None = None, spare=()) -> Entry | None:
        """A new entry (one reference, not ready) for `key`, child of `parent`'s entry if there is
        one, evicting the least recently used evictable entry not in `spare` when no slot is free;
        None when there is none."""
        if key in self.index:
            raise ValueError("key already stored")
        if not self.free and not self._evict_one(spare):
            return None
        up = self.index.get(parent) if parent is not None else None
        entry = Entry(self.free.pop(), parent=up)
        if up is not None:
            up.children += 1
        self.index[key] = entry
        return entry

    def _evict_one(self, spare=()) -> bool:
        """Drop the least recently used ready, unreferenced leaf not in `spare`; the entries with
        children passed on the way are moved to the newest end."""
        passed, victim = [], None
        for key, e in self.index.items():
            if not e.ready or e.refs or key in spare:
                continue
            if e.children:
                passed.append(key)
                continue
            victim = key
            break
        for key in passed:
            self.index.move_to_end(key)
        if victim is None:
            return False
        self.drop(victim)
        return True

    def drop(self, key: Key) -> None:
        e = self.index.pop(key)
        self.free.append(e.slot)
        if e.parent is not None:          # (a parent dropped before it is detached: harmless)
            e.parent.children -= 1
            e.parent = None

    def acquire(self, keys) -> None:
        for k in keys:
            self.index[k].refs += 1

    def release(self, keys) -> None:
        for k in keys:
            e = self.index.get(k)
            if e is not None:
                if e.refs <= 0:
                    raise ValueError("release of an unreferenced host entry")
                e.refs -= 1

    def touch(self, keys) -> None:
        """Most recent use: `keys` in order (pass a chain deepest first so ancestors end up newest)."""
        for k in keys:
            if k in self.index:
                self.index.move_to_end(k)

    def nbytes_used(self) -> int:
        return len(self.index) * self.rows[0].numel() * self.rows.element_size() if self.capacity else 0


class HostStore:
    """Pinned pools sized from a byte budget: one tail per TAIL_EVERY pages (and at least two)."""

    TAIL_EVERY = 8

    def __init__(self, page_numel: int, tail_numel: int, dtype: torch.dtype, budget_bytes: int, pin: bool):
        elem = torch.empty((), dtype=dtype).element_size()
        unit = (self.TAIL_EVERY * page_numel + tail_numel) * elem
        tails = max(2, budget_bytes // unit)
        pages = max(0, (budget_bytes - tails * tail_numel * elem) // (page_numel * elem))
        if pages < 1:
            raise ValueError(f"host cache of {budget_bytes / 2**20:.1f} MiB holds no history page "
                             f"({page_numel * elem / 2**20:.2f} MiB) beside two checkpoints "
                             f"({tail_numel * elem / 2**20:.2f} MiB each): raise host_cache_gb")
        self.pages = Pool(torch.empty(pages, page_numel, dtype=dtype, pin_memory=pin))
        self.tails = Pool(torch.empty(tails, tail_numel, dtype=dtype, pin_memory=pin))

    def nbytes(self) -> int:
        return sum(p.rows.numel() * p.rows.element_size() for p in (self.pages, self.tails))
