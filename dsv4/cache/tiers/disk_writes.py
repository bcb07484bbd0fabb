"""Writing the host tier's prefixes to disk (docs/architecture.md, "Host and disk tiers"): part
of `KVTiers` (tiers.py), whose state it uses.

A stored prefix is written as one group file (files.py) by the disk thread, after its parent
group; the group's host entries stay referenced until the write is collected (`_poll_writes`,
on the step's thread, which never waits for it).
"""
from __future__ import annotations

import logging
import time

from .files import encode_parts, group_name
from .jobs import DiskWrite
from .keys import Key

log = logging.getLogger("dsv4.cache.tiers")


class DiskWriting:
    def _write_disk(self, keys: list[Key]) -> None:
        """Write the chain's pages the disk lacks (and its tail) as one group, after its parent.
        The pages on disk (or being written) are a prefix of any chain (a group is published only
        after its parent), so they are found from the end: O(pages written), not O(chain)."""
        disk = self.disk
        if disk is None:
            return
        on_disk = lambda h: h in disk.page_file or h in self._writing_pages  # noqa: E731
        a = len(keys)
        while a and not on_disk(keys[a - 1].hex()):
            a -= 1
        last = keys[-1].hex()
        tail = self.host.tails.has(keys[-1]) and last not in disk.tail_file
        if a == len(keys):
            if not tail:
                return
            a -= 1                            # the last page again, with its tail
        name, parent_hex = group_name(last, tail), keys[a - 1].hex() if a else ""
        parent = (disk.page_file.get(parent_hex) or self._writing_pages.get(parent_hex)) if a else None
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
        sig, hexes = self.fmt.signature, [k.hex() for k in group]

        def build() -> list:                  # (disk thread) the entries are referenced meanwhile
            rows = hp.rows[slots]
            return encode_parts(sig, parent_hex, hexes, rows, ht.rows[tail_slot] if tail else None)

        nbytes = len(group) * self.page_bytes + tail * self.tail_bytes
        self.writes[name] = DiskWrite(disk.write(name, parent, build), name, group, keys[-1] if tail else None,
                                      nbytes)
        for h in hexes:
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
