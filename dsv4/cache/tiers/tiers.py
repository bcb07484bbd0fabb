"""Host-RAM and disk tiers behind the GPU prefix cache (docs/architecture.md, "Host and disk tiers").

Storing (`offload`, called from `CacheManager` each time a request's commit checkpoints a page
boundary L): the prefix's history pages the host lacks and the tail at L are copied into new
host entries by the mover; the GPU pages keep one extra reference until *packed* (then the GPU
may evict and reuse them), the host entries become readable when *stored*. A stored prefix is
then written to disk as one group file (disk.py), after its parent group.

Restoring (`fetch`, called at admission for a request the GPU cache would resume at G tokens):
when the tiers hold a deeper checkpointed prefix (pages 0..d-1 on the GPU tree, in host entries
or on disk, and a tail at 256 d), missing pages are read from disk into host entries first, then
copied from the host into new GPU pages and the tail into a GPU buffer; when the copy is done
the pages join the prefix tree and the tail becomes a checkpoint of the node at depth d, so the
request (and any other) resumes there as from any GPU hit. Meanwhile the request waits and the
others step; every page and entry a copy uses stays referenced until it finishes.

All bookkeeping runs on the caller's thread (`poll` collects finished copies); only copies run
elsewhere (side stream, disk thread).
"""
from __future__ import annotations

import logging
import time

from ..layout import PAGE_TOKENS
from .codec import PageCodec
from .disk import DiskStore
from .executors import make_executor
from .files import encode, group_name
from .host import HostStore
from .jobs import DiskRead, DiskWrite, LoadJob, StoreJob
from .keys import Key, chain_keys, root_key
from .movers import make_mover
from .options import TierOptions
from .stats import BUCKETS, TierStats

log = logging.getLogger("dsv4.cache.tiers")


class KVTiers:
    def __init__(self, options: TierOptions, storage, pages, tree):
        self.storage, self.pages, self.tree = storage, pages, tree
        self.fmt = storage.checkpoint_format
        self.codec = PageCodec(storage)
        device = storage.kinds["c4"].device
        cuda = device.type == "cuda"
        background = cuda if options.background is None else options.background
        self.mover = make_mover(device)
        self.executor = make_executor(background)
        self.stats = TierStats()
        self.host = HostStore(self.codec.numel, self.fmt.numel, self.codec.dtype, options.host_bytes, pin=cuda)
        self.disk = (DiskStore(options.disk_dir, options.disk_bytes, self.fmt.signature, self.executor, self.stats)
                     if options.disk_dir else None)
        self.root = root_key(self.fmt.signature)
        self.page_bytes = self.codec.numel * self.host.pages.rows.element_size()
        self.tail_bytes = self.fmt.numel * self.host.tails.rows.element_size()
        self.stores: list[StoreJob] = []
        self.loads: dict[Key, LoadJob] = {}
        self.reads: dict[Key, DiskRead] = {}
        self.writes: dict[str, DiskWrite] = {}
        self._writing_pages: dict[str, str] = {}     # page key (hex) -> file being written
        self._read: set[Key] = set()                 # targets read from disk already (not read again)
        self._from_disk: set[Key] = set()            # host tails a disk read brought (a load of one is a disk hit)
        self._memo: dict[str, list[Key]] = {}        # request id -> chain keys of its tokens so far
        u = self.usage()
        log.info("KV tiers: host %.2f GiB (%d pages of %.2f MiB, %d checkpoints of %.2f MiB)%s",
                 self.host.nbytes() / 2**30, u["host_pages_total"], self.page_bytes / 2**20, u["host_tails_total"],
                 self.tail_bytes / 2**20, f"; disk {options.disk_dir}: {u['disk_files']} groups, "
                 f"{u['disk_bytes_used'] / 2**30:.2f} of {options.disk_bytes / 2**30:.2f} GiB" if self.disk else "")

    # ---- storing ---------------------------------------------------------------------------
    def keys(self, tokens: list[int], num_pages: int, owner: str | None = None) -> list[Key]:
        """Chain keys of `tokens`' first pages; with an `owner` (a request id, whose tokens only
        grow) the keys computed before are kept until `forget(owner)`, so each page is hashed once."""
        known = self._memo.get(owner, ()) if owner is not None else ()
        keys = chain_keys(self.root, tokens, num_pages, known)
        if owner is not None and len(keys) > len(known):
            self._memo[owner] = keys
        return keys

    def forget(self, owner: str) -> None:
        self._memo.pop(owner, None)

    def offload(self, tokens: list[int], gpu_pages: list[int], L: int, tail, owner: str | None = None) -> None:
        """Store the prefix `tokens` [0, L) (GPU pages `gpu_pages`, checkpoint row `tail` at L)."""
        self.poll()
        keys = self.keys(tokens, L // PAGE_TOKENS, owner)
        hp, ht = self.host.pages, self.host.tails
        hp.touch(reversed(keys))
        ht.touch(keys[-1:])
        new = [i for i, key in enumerate(keys) if key not in hp.index]
        want_tail = keys[-1] not in ht.index
        if not new and not want_tail:
            self._write_disk(keys)
            return
        held = [key for key in keys if key in hp.index]
        hp.acquire(held)                      # the chain's own entries are not evicted for its new ones
        try:
            made = self._reserve(keys, new, want_tail)
        finally:
            hp.release(held)
        if made is None:
            self.stats.host_full += 1
            return
        page_entries, tail_entry = made
        src = [gpu_pages[i] for i in new]
        self.pages.incref(src)                # until packed
        ticket = self.mover.store(self.codec, src, hp.rows, [e.slot for e in page_entries],
                                  tail if want_tail else None, ht.rows[tail_entry.slot] if want_tail else None)
        nbytes = len(src) * self.page_bytes + want_tail * self.tail_bytes
        self.stores.append(StoreJob(ticket, src, [keys[i] for i in new], keys[-1] if want_tail else None,
                                    keys, nbytes))
        self._poll_stores()

    def _reserve(self, keys, new, want_tail):
        hp, ht = self.host.pages, self.host.tails
        entries = []
        for i in new:
            e = hp.reserve(keys[i])
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

    # ---- disk writes -----------------------------------------------------------------------
    def _write_disk(self, keys: list[Key]) -> None:
        """Write the chain's pages the disk lacks (and its tail) as one group, after its parent."""
        disk = self.disk
        if disk is None:
            return
        hexes = [k.hex() for k in keys]
        on_disk = lambda h: h in disk.page_file or h in self._writing_pages  # noqa: E731
        a = next((i for i, h in enumerate(hexes) if not on_disk(h)), len(keys))
        tail = self.host.tails.has(keys[-1]) and hexes[-1] not in disk.tail_file
        if a == len(keys):
            if not tail:
                return
            a -= 1                            # the last page again, with its tail
        name = group_name(hexes[-1], tail)
        parent = (disk.page_file.get(hexes[a - 1]) or self._writing_pages.get(hexes[a - 1])) if a else None
        group = keys[a:]
        if name in self.writes or name in disk.files or (a and parent is None) \
                or not all(self.host.pages.has(k) for k in group):
            return
        hp, ht = self.host.pages, self.host.tails
        hp.acquire(group)
        if tail:
            ht.acquire(keys[-1:])
        slots = [hp.index[k].slot for k in group]
        tail_slot = ht.index[keys[-1]].slot if tail else None
        sig, parent_hex = self.fmt.signature, hexes[a - 1] if a else ""

        def build() -> bytes:                 # (disk thread) the entries are referenced meanwhile
            rows = hp.rows[slots]
            return encode(sig, parent_hex, hexes[a:], rows, ht.rows[tail_slot] if tail else None)

        nbytes = len(group) * self.page_bytes + tail * self.tail_bytes
        self.writes[name] = DiskWrite(disk.write(name, parent, build), name, group, keys[-1] if tail else None,
                                      nbytes)
        for h in hexes[a:]:
            self._writing_pages.setdefault(h, name)

    def _poll_writes(self) -> None:
        for name, job in list(self.writes.items()):
            if not job.future.done():
                continue
            del self.writes[name]
            for k in job.page_keys:
                if self._writing_pages.get(k.hex()) == name:
                    del self._writing_pages[k.hex()]
            self.host.pages.release(job.page_keys)
            self.host.tails.release([job.tail_key] if job.tail_key else [])
            err = job.future.exception()
            if err is not None:
                self.stats.disk_write_errors += 1
                log.warning("disk KV cache: writing %s failed (%s); it is not published", name, err)
                continue
            head, size = job.future.result()
            self.disk.published(name, head, size)
            self.stats.bytes["host_to_disk"] += job.nbytes
            self.stats.latency["disk_store"].observe(time.perf_counter() - job.start)

    # ---- restoring -------------------------------------------------------------------------
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
        ticket = self.mover.load(self.codec, hp.rows, [hp.index[k].slot for k in host_keys], new, ht.row(tail_key))
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

    # ---- the rest --------------------------------------------------------------------------
    def poll(self) -> None:
        """Collect finished copies (cheap when none is)."""
        self._poll_stores()
        self._poll_writes()
        self._poll_reads()
        self._poll_loads()

    @property
    def busy(self) -> bool:
        return bool(self.stores or self.loads or self.reads or self.writes)

    def drain(self) -> None:
        """Wait for every copy in flight and collect it (tests, benchmarks, shutdown)."""
        while self.busy:
            for job in [*self.stores, *self.loads.values()]:
                job.ticket.wait()
            for job in [*self.reads.values(), *self.writes.values()]:
                job.future.exception()
            self.poll()

    def usage(self) -> dict:
        hp, ht = self.host.pages, self.host.tails
        return {"host_pages_used": len(hp.index), "host_pages_total": hp.capacity,
                "host_tails_used": len(ht.index), "host_tails_total": ht.capacity,
                "host_bytes_used": hp.nbytes_used() + ht.nbytes_used(), "host_bytes_total": self.host.nbytes(),
                "disk_files": len(self.disk.files) if self.disk else 0,
                "disk_bytes_used": self.disk.nbytes if self.disk else 0,
                "disk_bytes_total": self.disk.budget if self.disk else 0}

    def drop_host(self) -> int:
        """Forget every unreferenced host entry (the disk keeps its copies); entries dropped."""
        n = 0
        for pool in (self.host.pages, self.host.tails):
            for key, e in list(pool.index.items()):
                if e.ready and not e.refs:
                    pool.drop(key)
                    n += 1
        return n

    def report(self) -> dict:
        """The `EngineStats` fields of the tiers (engine/ipc.py)."""
        st = self.stats
        return {"tier_hit_tokens": dict(st.hit_tokens), "tier_bytes": dict(st.bytes),
                "tier_latency": {k: [*h.cumulative(), h.total] for k, h in st.latency.items()},
                "tier_buckets": list(BUCKETS), "tier_usage": self.usage()}

    def close(self) -> None:
        self.drain()
        self.executor.shutdown(wait=True)
