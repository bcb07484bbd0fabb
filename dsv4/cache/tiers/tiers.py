"""Host-RAM and disk tiers behind the GPU prefix cache (docs/architecture.md, "Host and disk tiers").

`KVTiers` holds the tiers' state; its jobs live in their own files: storing into the host tier
(storing.py, `offload`), writing groups to disk (disk_writes.py) and restoring into the GPU
prefix tree (restoring.py, `fetch`). All bookkeeping runs on the caller's thread (`poll`
collects finished copies and never waits); only copies run elsewhere (issued by the mover's
thread onto the side stream of streams.py, and file reads and writes on the disk thread of
executors.py).
"""
from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, wait

from .codec import PageCodec
from .disk import DiskStore
from .disk_writes import DiskWriting
from .executors import make_executor
from .host import HostStore
from .jobs import DiskRead, DiskWrite, LoadJob, StoreJob
from .keys import Key, chain_keys, extend_chain, root_key
from .movers import make_mover
from .options import TierOptions
from .restoring import Restoring
from .stats import BUCKETS, TierStats
from .storing import Storing

log = logging.getLogger("dsv4.cache.tiers")


class KVTiers(Storing, DiskWriting, Restoring):
    def __init__(self, options: TierOptions, storage, pages, tree):
        self.storage, self.pages, self.tree = storage, pages, tree
        self.fmt = storage.checkpoint_format
        self.codec = PageCodec(storage)
        device = storage.kinds["c4"].device
        cuda = device.type == "cuda"
        background = cuda if options.background is None else options.background
        self.mover = make_mover(self.codec, background)
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

    # ---- chain keys ------------------------------------------------------------------------
    def keys(self, tokens: list[int], num_pages: int, owner: str | None = None) -> list[Key]:
        """Chain keys of `tokens`' first pages; with an `owner` (a request id, whose tokens only
        grow) the keys computed before are kept until `forget(owner)`, so each page is hashed once."""
        if owner is None:
            return chain_keys(self.root, tokens, num_pages)
        known = self._memo.setdefault(owner, [])
        extend_chain(self.root, tokens, known, num_pages)
        return known if len(known) == num_pages else known[:num_pages]    # (callers never change it)

    def forget(self, owner: str) -> None:
        self._memo.pop(owner, None)

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

    def wait_briefly(self, timeout: float) -> None:
        """Block up to `timeout` s, the GIL released, until a copy in flight is through its
        thread. An engine with nothing to run waits here instead of spinning: a spinning loop
        holds the GIL, and the tiers' threads then get it a switch interval (5 ms) at a time."""
        jobs = (*self.reads.values(), *self.writes.values())
        futures = [j.future for j in jobs] + [j.ticket.future for j in (*self.stores, *self.loads.values())]
        pending = [f for f in futures if not f.done()]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

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
        self.mover.close()
