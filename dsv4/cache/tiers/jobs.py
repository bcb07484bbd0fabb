"""The copies in flight between tiers, as the tiers track them (tiers.py)."""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from .keys import Key
from .movers import Ticket


@dataclass(eq=False)
class StoreJob:
    """GPU pages (+ a checkpoint tail) being copied into new host entries."""
    ticket: Ticket
    gpu_pages: list[int]             # GPU references held until packed
    page_keys: list[Key]             # the new host page entries
    tail_key: Key | None             # the new host tail entry
    chain: list[Key]                 # keys of pages 0..k-1 of the prefix (its disk group follows)
    nbytes: int
    start: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class LoadJob:
    """Host rows being copied into new GPU pages; registered in the prefix tree when done."""
    ticket: Ticket
    tokens: list[int]                # the prefix's tokens, [0, 256 depth)
    depth: int                       # pages; the checkpoint is at 256 depth
    prefix_pages: list[int]          # GPU pages already in the tree (held until done)
    new_pages: list[int]             # GPU pages being written (held until done)
    chain: list[Key]                 # keys of pages 0..depth-1
    host_keys: list[Key]             # host page entries read (referenced until done)
    tail_key: Key                    # host tail entry read (referenced until done)
    tier: str                        # "host" or "disk": where the restored part came from
    gpu_tokens: int                  # what the GPU prefix cache alone would have resumed
    nbytes: int
    start: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class FileRead:
    """One group file being read into new host entries (None: the host had the key already)."""
    name: str
    keys: list[Key]                  # its pages' keys
    page_entries: list               # host page Entry (reserved, unready, one reference) or None
    tail_key: Key | None             # its tail's key, if it has a tail
    tail_entry: object = None        # host tail Entry or None


@dataclass(eq=False)
class DiskRead:
    """Group files being read into host entries."""
    future: Future
    files: list[FileRead]
    chain: list[Key]                 # host entries of the chain referenced meanwhile
    start: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class DiskWrite:
    """A group file being written from host entries (referenced until written)."""
    future: Future
    name: str
    page_keys: list[Key]
    tail_key: Key | None
    nbytes: int
    start: float = field(default_factory=time.perf_counter)
