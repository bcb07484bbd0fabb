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
from .jobs import DiskRead, FileRead, LoadJob


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
                if not self._start_read(keys, g, depth):
                    return False
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

    def _start_read(self, keys, g, depth) -> bool:
        """Reserve host entries for the group files holding the chain's pages the host lacks (and
        the tail) and have the disk thread read the files straight into them; False (nothing
        started) when the host has no room. The step's thread copies nothing: `_poll_reads` only
        publishes the entries of the files that were read and checked."""
        disk, hp, ht = self.disk, self.host.pages, self.host.tails
        names = [disk.page_file[k.hex()] for k in keys[g:depth] if not hp.has(k)]
        if not ht.has(keys[depth - 1]):
            names.append(disk.tail_file[keys[depth - 1].hex()])
        chain = [k for k in keys[:depth] if k in hp.index]
        hp.acquire(chain)                     # (before reserving: its entries are not evicted for the new)
        files = self._reserve_files(list(dict.fromkeys(names)))
        if files is None:
            hp.release(chain)
            self.stats.host_full += 1
            return False
        disk.touch([f.name for f in files])
        future = disk.read([(f.name, [hp.rows[e.slot] if e else None for e in f.page_entries],
                             ht.rows[f.tail_entry.slot] if f.tail_entry else None) for f in files])
        self.reads[keys[depth - 1]] = DiskRead(future, files, chain)
        return True

    def _reserve_files(self, names: list[str]) -> list[FileRead] | None:
        """New (unready, referenced) host entries for the files' pages and tails the host has no
        entry for (None where it has: that row is read and dropped); None if a slot is missing."""
        hp, ht, files = self.host.pages, self.host.tails, []
        for name in names:
            head = self.disk.files[name][0]
            keys = [bytes.fromhex(h) for h in head.keys]
            f = FileRead(name, keys, [None] * len(keys), keys[-1] if head.tail else None)
            files.append(f)
            parents = [bytes.fromhex(head.parent) if head.parent else None, *keys[:-1]]
            want = [(hp, i, key, parents[i]) for i, key in enumerate(keys) if key not in hp.index]
            if f.tail_key is not None and f.tail_key not in ht.index:
                want.append((ht, None, f.tail_key, None))
            for pool, i, key, parent in want:
                e = pool.reserve(key, parent)
                if e is None:
                    for done in files:
                        self._drop_entries(done)
                    return None
                if i is None:
                    f.tail_entry = e
                else:
                    f.page_entries[i] = e
        return files

    def _drop_entries(self, f: FileRead) -> None:
        hp, ht = self.host.pages, self.host.tails
        for key, e in zip(f.keys, f.page_entries):
            if e and hp.index.get(key) is e:
                hp.drop(key)
        if f.tail_entry and ht.index.get(f.tail_key) is f.tail_entry:
            ht.drop(f.tail_key)
        f.page_entries, f.tail_entry = [None] * len(f.keys), None

    def _poll_reads(self) -> None:
        hp, ht = self.host.pages, self.host.tails
        for target, job in list(self.reads.items()):
            if not job.future.done():
                continue
            del self.reads[target]
            names = [f.name for f in job.files]
            self.disk.done_reading(names)
            results = job.future.result()
            for f, got in zip(job.files, results):
                if isinstance(got, Exception):
                    self.disk.remove(f.name, why=f"not loaded: {got}")
            moved = 0
            for f, got in zip(job.files, results):
                # files still indexed were read whole and checked, and their parents were not refused
                if isinstance(got, Exception) or f.name not in self.disk.files:
                    self._drop_entries(f)
                    continue
                self._settle(hp, [k for k, e in zip(f.keys, f.page_entries) if e])
                if f.tail_entry:
                    self._settle(ht, [f.tail_key])
                    self._from_disk.add(f.tail_key)
                moved += got
            hp.release(job.chain)
            if len(self._read) > 4096:            # targets never loaded: forget them (bounded memory)
                self._read.clear()
                self._from_disk.clear()
            self._read.add(target)
            self.stats.bytes["disk_to_host"] += moved
            self.stats.latency["disk_load"].observe(time.perf_counter() - job.start)

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
