"""Restoring from the host and disk tiers (docs/architecture.md, "Host and disk tiers"): part of
`KVTiers` (tiers.py), whose state it uses.

`fetch` (called at admission for a request the GPU cache would resume at G tokens): when the
tiers hold a deeper checkpointed prefix (pages 0..d-1 on the GPU tree, in host entries or on
disk, and a tail at 256 d), missing pages are read from disk into host entries first, then
copied from the host into new GPU pages and the tail into a GPU buffer; when the copy is done
the pages join the prefix tree and the tail becomes a checkpoint of the node at depth d, so the
request (and any other) resumes there as from any GPU hit. Meanwhile the request waits and the
others step; every page and entry a copy uses stays referenced until it finishes.
"""
from __future__ import annotations

import time

from ..layout import PAGE_TOKENS
from .jobs import DiskRead, LoadJob
from .keys import Key


class Restoring:
    def fetch(self, tokens: list[int], limit: int, gpu_tokens: int, owner: str | None = None) -> bool:
        """For a waiting request whose GPU hit resumes at `gpu_tokens` (0: none): start restoring
        a deeper checkpoint of `tokens` (at most `limit`) from the tiers. True while one it would
        resume from is being restored (the request waits); False when it can be admitted now."""
        self.poll()
        n = limit // PAGE_TOKENS
        if n * PAGE_TOKENS <= gpu_tokens:
            return False
        keys = self.keys(tokens, n, owner)
        if any(k in self.loads or k in self.reads for k in keys):
            return True
        for _ in range(2):                     # a finished disk read makes a host load possible
            plan = self._plan(tokens, keys, gpu_tokens)
            if plan is None:
                return False
            depth, g, need_disk = plan
            target = keys[depth - 1]
            if need_disk:
                self._start_read(keys, g, depth)
            elif not self._start_load(tokens, keys, g, depth, gpu_tokens):
                return False
            self.poll()
            if target not in self.loads and target not in self.reads and need_disk:
                continue                       # read at once (synchronous): now load from the host
            return target in self.loads or target in self.reads
        return False

    def _plan(self, tokens, keys, gpu_tokens):
        """(depth, GPU path pages, whether the disk is needed) of the deepest checkpointed prefix
        the tiers can restore, deeper than the GPU's hit and fitting the host; None if none."""
        hp, ht, disk = self.host.pages, self.host.tails, self.disk
        g = len(self.tree.path_nodes(tokens, len(keys)))
        best = host_best = None
        host_chain = True
        for i, key in enumerate(keys):
            in_host = i < g or hp.has(key)
            if not in_host and not (disk is not None and key.hex() in disk.page_file):
                break
            host_chain = host_chain and in_host
            if i - g + 1 > hp.capacity:
                break
            tail_host = ht.has(key)
            if host_chain and tail_host:
                host_best = i + 1
            if tail_host or (disk is not None and key.hex() in disk.tail_file):
                best = i + 1
        if best is not None and keys[best - 1] in self._read:
            best = host_best                  # read once already: take what the host kept
        if best is None or best * PAGE_TOKENS <= gpu_tokens:
            return None
        return best, min(g, best), best != host_best

    def _start_read(self, keys, g, depth) -> None:
        disk, hp, ht = self.disk, self.host.pages, self.host.tails
        names = [disk.page_file[k.hex()] for k in keys[g:depth] if not hp.has(k)]
        if not ht.has(keys[depth - 1]):
            names.append(disk.tail_file[keys[depth - 1].hex()])
        names = list(dict.fromkeys(names))
        chain = [k for k in keys[:depth] if k in hp.index]
        hp.acquire(chain)
        disk.touch(names)
        self.reads[keys[depth - 1]] = DiskRead(disk.read(names), names, chain)

    def _poll_reads(self) -> None:
        hp, ht = self.host.pages, self.host.tails
        for target, job in list(self.reads.items()):
            if not job.future.done():
                continue
            del self.reads[target]
            self.disk.done_reading(job.names)
            moved, results = 0, list(zip(job.names, job.future.result()))
            for name, got in results:
                if isinstance(got, Exception):
                    self.disk.remove(name, why=f"not loaded: {got}")
            for name, got in results:        # files still indexed: their parents were not refused
                if isinstance(got, Exception) or name not in self.disk.files:
                    continue
                head, rows, tail = got
                for kh, row in zip(head.keys, rows):
                    moved += self._put(hp, bytes.fromhex(kh), row)
                if tail is not None and self._put(ht, bytes.fromhex(head.keys[-1]), tail):
                    moved += tail.numel() * tail.element_size()
                    self._from_disk.add(bytes.fromhex(head.keys[-1]))
            hp.release(job.chain)
            if len(self._read) > 4096:            # targets never loaded: forget them (bounded memory)
                self._read.clear()
                self._from_disk.clear()
            self._read.add(target)
            self.stats.bytes["disk_to_host"] += moved
            self.stats.latency["disk_load"].observe(time.perf_counter() - job.start)

    @staticmethod
    def _put(pool, key: Key, row) -> int:
        """A ready host entry for `key` holding `row` (bytes copied; 0 if present or no room)."""
        if key in pool.index:
            return 0
        e = pool.reserve(key)
        if e is None:
            return 0
        pool.rows[e.slot].copy_(row)
        e.ready, e.refs = True, 0
        return row.numel() * row.element_size()

    def _start_load(self, tokens, keys, g, depth, gpu_tokens) -> bool:
        hp, ht = self.host.pages, self.host.tails
        prefix = [n.page for n in self.tree.path_nodes(tokens, g)]
        self.pages.incref(prefix)             # held: eviction below cannot take them
        need = depth - g
        if need > self.pages.num_free:
            self.tree.evict(need - self.pages.num_free)
        if need > self.pages.num_free:
            self.pages.free(prefix)
            return False
        new = self.pages.allocate(need)
        host_keys, tail_key = keys[g:depth], keys[depth - 1]
        hp.acquire(host_keys)
        ht.acquire([tail_key])
        hp.touch(reversed(keys[:depth]))
        ticket = self.mover.load(hp.rows, [hp.index[k].slot for k in host_keys], new, ht.row(tail_key))
        tier = "disk" if tail_key in self._from_disk else "host"
        self._from_disk.discard(tail_key)
        self._read.discard(tail_key)
        self.loads[tail_key] = LoadJob(ticket, list(tokens[:depth * PAGE_TOKENS]), depth, prefix, new, keys[:depth],
                                       host_keys,
                                       tail_key, tier, gpu_tokens, need * self.page_bytes + self.tail_bytes)
        return True

    def _poll_loads(self) -> None:
        for target, job in list(self.loads.items()):
            if not job.ticket.done():
                continue
            del self.loads[target]
            job.ticket.finish()
            node, _ = self.tree.insert(job.tokens, job.prefix_pages + job.new_pages, self.tree.root, job.depth)
            self.pages.free(job.prefix_pages + job.new_pages)     # the tree keeps what it took
            slot = self.tree.add_checkpoint(node)
            if slot is not None:
                self.storage.checkpoints[slot].copy_(job.ticket.tail)
            self.host.pages.release(job.host_keys)
            self.host.tails.release([job.tail_key])
            self.stats.hit_tokens[job.tier] += job.depth * PAGE_TOKENS - job.gpu_tokens
            self.stats.bytes["host_to_gpu"] += job.nbytes
            self.stats.latency["host_load"].observe(time.perf_counter() - job.start)
            self._write_disk(job.chain)        # heals a group the disk lost or failed to write
