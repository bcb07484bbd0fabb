"""Storing into the host tier (docs/architecture.md, "Host and disk tiers"): part of `KVTiers`
(tiers.py), whose state it uses.

`offload` (called from `CacheManager` each time a request's commit checkpoints a page boundary
L): the prefix's history pages the host lacks and the tail at L are copied into new host
entries by the mover; the GPU pages keep one extra reference until *packed* (then the GPU may
evict and reuse them), the host entries become readable when *stored*. A stored prefix is then
written to disk as one group file (disk_writes.py). On the step's thread: bookkeeping of
O(new pages) Python work (what runs over the whole chain is a few C-speed passes) and the copy
queued (movers.py: the mover's thread issues its launches); nothing waits.
"""
from __future__ import annotations

import time
from itertools import compress
from operator import not_

from ..layout import PAGE_TOKENS
from .jobs import StoreJob


class Storing:
    def offload(self, tokens: list[int], gpu_pages: list[int], L: int, tail, owner: str | None = None) -> None:
        """Store the prefix `tokens` [0, L) (GPU pages `gpu_pages`, checkpoint row `tail` at L).
        Python work per new page only: the chain's deepest entry is refreshed (its ancestors are
        kept by the leaves-first rule of host.py), which pages the host lacks is one C-speed
        pass, and the copy itself is queued for the mover's thread."""
        self.poll()
        n = L // PAGE_TOKENS
        keys = self.keys(tokens, n, owner)
        hp, ht = self.host.pages, self.host.tails
        hp.touch(keys[-1:])
        ht.touch(keys[-1:])
        new = list(compress(range(n), map(not_, map(hp.index.__contains__, keys))))
        want_tail = keys[-1] not in ht.index
        if not new and not want_tail:
            self._write_disk(keys)
            return
        made = self._reserve(keys, new, want_tail)
        if made is None:
            self.stats.host_full += 1
            return
        page_entries, tail_entry = made
        src = [gpu_pages[i] for i in new]
        self.pages.incref(src)                # until packed
        ticket = self.mover.store(src, hp.rows, [e.slot for e in page_entries],
                                  tail if want_tail else None, ht.rows[tail_entry.slot] if want_tail else None)
        nbytes = len(src) * self.page_bytes + want_tail * self.tail_bytes
        self.stores.append(StoreJob(ticket, src, [keys[i] for i in new], keys[-1] if want_tail else None,
                                    keys[:n], nbytes))
        self._poll_stores()

    def _reserve(self, keys, new, want_tail):
        hp, ht = self.host.pages, self.host.tails
        spare = {keys[i - 1] for i in new if i}     # a new page's parent (a leaf until then) stays
        entries = []
        for i in new:
            e = hp.reserve(keys[i], keys[i - 1] if i else None, spare)
            if e is None:
                break
            entries.append(e)
        tail = ht.reserve(keys[-1]) if want_tail and len(entries) == len(new) else None
        if len(entries) < len(new) or (want_tail and tail is None):
            for i in new[:len(entries)]:
                hp.drop(keys[i])
            return None
        return entries, tail

    def _poll_stores(self) -> None:
        for job in list(self.stores):
            if job.gpu_pages and (job.ticket.packed() or job.ticket.done()):
                self.pages.free(job.gpu_pages)
                job.gpu_pages = []
            if not job.ticket.done():
                continue
            job.ticket.finish()
            self._settle(self.host.pages, job.page_keys)
            self._settle(self.host.tails, [job.tail_key] if job.tail_key else [])
            self.stats.bytes["gpu_to_host"] += job.nbytes
            self.stats.latency["host_store"].observe(time.perf_counter() - job.start)
            self.stores.remove(job)
            self._write_disk(job.chain)

    @staticmethod
    def _settle(pool, keys) -> None:
        for key in keys:
            e = pool.index[key]
            e.ready, e.refs = True, e.refs - 1
