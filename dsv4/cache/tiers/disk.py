"""The disk tier's folder and index (docs/architecture.md, "Host and disk tiers").

Files (files.py) are written by the executor (a background thread when serving) and read the
same way, straight into the host entries reserved for them (no copy on the calling thread);
the index (which page and tail keys which file holds, least recently used first) is changed
only on the calling thread, when a write or read is collected.

Publishing: a group is written to a temporary name, flushed to disk, then renamed to its own
name, and only if its parent's file (the group holding the page before its first one) exists
at that moment. So a file under its own name is complete, and a reader never finds page k
without pages < k (cumulative hash-chain order). At start (`scan`) the folder is indexed:
files of another layout signature are ignored (left alone, never loaded), truncated or
unreadable ones and temporary files left by a killed write are deleted, and a file whose
parent is missing is dropped with them. A file that fails its checksum when read is deleted;
the next store of its prefix writes it again.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from concurrent.futures import Future

from .files import SUFFIX, Corrupt, Header, SignatureMismatch, check, parse_header, read_group_into, read_header

log = logging.getLogger("dsv4.cache.tiers")
TMP = ".tmp-"


def write_file(path: str, parts: list) -> None:
    """Write the buffers `parts` in order as one file and flush it (a seam: tests inject write
    errors here)."""
    with open(path, "wb") as f:
        for part in parts:
            f.write(part)
        f.flush()
        os.fsync(f.fileno())


def _write_group(folder: str, name: str, parent: str | None, build) -> tuple[Header, int]:
    """(executor) Write one group (`build()`: its buffers, files.encode_parts) and publish it by
    rename, if its parent is published."""
    if parent is not None and not os.path.exists(os.path.join(folder, parent)):
        raise FileNotFoundError(f"parent group {parent} is not on disk")
    parts = build()
    tmp = os.path.join(folder, f"{TMP}{os.getpid()}-{name}")
    try:
        write_file(tmp, parts)
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return parse_header(parts[0]), sum(memoryview(p).nbytes for p in parts)


class DiskStore:
    def __init__(self, folder: str, budget_bytes: int, signature: str, executor, stats):
        self.folder, self.budget, self.signature = folder, budget_bytes, signature
        self.executor, self.stats = executor, stats
        self.files: OrderedDict[str, tuple[Header, int]] = OrderedDict()    # name -> (header, size), LRU first
        self.page_file: dict[str, str] = {}      # page key (hex) -> file
        self.tail_file: dict[str, str] = {}      # tail key (hex) -> file
        self.reading: dict[str, int] = {}        # files being read -> readers (never evicted meanwhile)
        os.makedirs(folder, exist_ok=True)
        self.scan()

    # ---- index -----------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files.values())

    def scan(self) -> None:
        found = []
        for entry in os.scandir(self.folder):
            path = entry.path
            if entry.name.startswith(TMP):
                self._bad(path, "a temporary file left by an interrupted write", delete=True)
            elif entry.name.endswith(SUFFIX):
                try:
                    head, size = read_header(path)
                    check(head, size, self.signature)
                    if head.name != entry.name:
                        raise Corrupt(f"named {entry.name}, its header says {head.name}")
                    found.append((entry.stat().st_mtime, entry.name, head, size))
                except SignatureMismatch as e:
                    self._bad(path, str(e), delete=False)
                except (Corrupt, OSError) as e:
                    self._bad(path, str(e), delete=True)
        waiting = sorted(found)
        while waiting:            # parents first: a file is indexed once its parent is
            rest = [f for f in waiting if not self._add_if_parented(f[1], f[2], f[3])]
            if len(rest) == len(waiting):
                for _, name, _, _ in rest:
                    self._bad(os.path.join(self.folder, name), "its parent group is missing", delete=True)
                break
            waiting = rest

    def _add_if_parented(self, name: str, head: Header, size: int) -> bool:
        if head.parent and head.parent not in self.page_file:
            return False
        self._add(name, head, size)
        return True

    def _add(self, name: str, head: Header, size: int) -> None:
        self.files[name] = (head, size)
        for k in head.keys:
            self.page_file.setdefault(k, name)
        if head.tail:
            self.tail_file.setdefault(head.keys[-1], name)

    def _bad(self, path: str, why: str, delete: bool) -> None:
        self.stats.disk_bad_files += 1
        log.warning("disk KV cache: %s %s: %s", "removing" if delete else "ignoring", path, why)
        if delete:
            try:
                os.remove(path)
            except OSError:
                pass

    def touch(self, names) -> None:
        for n in names:
            if n in self.files:
                self.files.move_to_end(n)

    def remove(self, name: str, why: str | None = None) -> None:
        """Drop a file from the index and the folder, then every file left without its parent."""
        if name not in self.files:
            return
        head, _ = self.files.pop(name)
        for k in head.keys:
            if self.page_file.get(k) == name:
                del self.page_file[k]
        if head.tail and self.tail_file.get(head.keys[-1]) == name:
            del self.tail_file[head.keys[-1]]
        path = os.path.join(self.folder, name)
        if why is not None:
            self._bad(path, why, delete=True)
        elif os.path.exists(path):
            os.remove(path)
        for other, (h, _) in list(self.files.items()):
            if h.parent and h.parent not in self.page_file:     # (a read of it in flight is dropped)
                self.remove(other)

    def evict_to_budget(self) -> None:
        for name in list(self.files):
            if self.nbytes <= self.budget:
                return
            if name not in self.reading and name in self.files:
                self.remove(name)

    # ---- writing and reading (through the executor) ----------------------------------------
    def write(self, name: str, parent: str | None, build) -> Future:
        """Write a group (`build()` gives its buffers) once `parent` (a file, None at the root) is
        published; the future gives (header, size)."""
        return self.executor.submit(_write_group, self.folder, name, parent, build)

    def published(self, name: str, head: Header, size: int) -> None:
        if head.parent and head.parent not in self.page_file:     # its parent went meanwhile
            self.remove_unindexed(name)
            return
        self._add(name, head, size)
        self.evict_to_budget()

    def remove_unindexed(self, name: str) -> None:
        path = os.path.join(self.folder, name)
        if name not in self.files and os.path.exists(path):
            os.remove(path)

    def read(self, jobs: list[tuple[str, list, object]]) -> Future:
        """Read group files into rows: `jobs` of (name, its page rows, its tail row), as
        files.read_group_into takes them; the future gives each file's bytes read or the
        exception that refused it, in order."""
        for name, _, _ in jobs:
            self.reading[name] = self.reading.get(name, 0) + 1
        work = [(os.path.join(self.folder, name), self.files[name][0], rows, tail) for name, rows, tail in jobs]
        return self.executor.submit(_read_all, work)

    def done_reading(self, names: list[str]) -> None:
        for n in names:
            self.reading[n] -= 1
            if not self.reading[n]:
                del self.reading[n]


def read_file(path: str, head: Header, rows: list, tail) -> int:
    """(executor) One group file into its rows (a seam: tests hold a read here)."""
    return read_group_into(path, head, rows, tail)


def _read_all(work: list) -> list:
    """(executor) Each file's bytes read into rows, or the exception that refused it."""
    out = []
    for path, head, rows, tail in work:
        try:
            out.append(read_file(path, head, rows, tail))
        except (Corrupt, SignatureMismatch, OSError, ValueError) as e:
            out.append(e)
    return out
