"""The running requests' page tables kept between steps (docs/architecture.md, "Cache").

One row per request state slot, in two pre-allocated arrays (history pages, SWA pages; -1 past
a table's end). Before a step each scheduled request's row is synced with its record, against
the copy of the table taken at the last write: an unchanged table costs one C-level list
comparison and no write, so a decode step copies no table. A changed one is rewritten only from
its first entry that differs from that copy on (`_take`), so a table that grew by appending
writes its new pages and a trimmed SWA table its window onward. That entry is looked for after
the slot's last write began (where a growing table changes next): the part before it is checked
whole in one C-level comparison, without copying it, and only the part after it (a few pages, or
a new table) is searched, by C-level comparisons of slices (`_common_prefix`): no Python work per
page. A growing request's chunk thus costs one pass of pointer comparisons over its tables and
the conversion of its new pages only.
Any change — pages appended, shared pages swapped in by the prefix cache (the length unchanged),
SWA pages trimmed, a new request in the slot — is seen; after a sync a row holds exactly its
table, then -1. `sync_rows` makes the unchanged-or-not comparisons for a whole step in C-level
maps, calling Python only for the rows that changed (a few a step: a page boundary crossed, a new
request). `build_step` then gathers the step's tables from the rows in a few vectorised
operations (`history_rows`, `swa_rows`), the same tables `_table` builds from the lists.
"""
from __future__ import annotations

from itertools import compress, islice
from operator import ne

import numpy as np

from .step_rows import StepRows


class PersistentTables:
    def __init__(self, slots: int, columns: int = 16):
        self.history = np.full((slots, columns), -1, np.int64)
        self.swa = np.full((slots, columns), -1, np.int64)
        # per slot: a copy of the tables its rows were last written from (None: never written)
        self._seen_history: list[list[int] | None] = [None] * slots
        self._seen_swa: list[list[int] | None] = [None] * slots
        # per slot: the first column its row's last write changed (where the next change is looked for)
        self._since_history = [0] * slots
        self._since_swa = [0] * slots
        self.writes = 0                 # rows rewritten so far (how incremental the updates are)

    def sync(self, slot: int, history: list[int], swa: list[int]) -> None:
        """Make row `slot` hold these tables."""
        if history != self._seen_history[slot]:
            self.history = _update(self.history, self._seen_history, self._since_history, slot, history)
            self.writes += 1
        if swa != self._seen_swa[slot]:
            self.swa = _update(self.swa, self._seen_swa, self._since_swa, slot, swa)
            self.writes += 1

    def sync_rows(self, rows: StepRows) -> None:
        """`sync` every row of a step, in order (a slot given twice ends with its last tables)."""
        slots = rows.slots.tolist()
        stale = list(map(ne, rows.page_tables, map(self._seen_history.__getitem__, slots)))
        stale_swa = list(map(ne, rows.swa_tables, map(self._seen_swa.__getitem__, slots)))
        if not any(stale) and not any(stale_swa):
            return
        if len(set(slots)) < len(slots):     # (a scratch slot shared by padding rows): row by row
            changed = range(len(slots))
        else:
            changed = compress(range(len(slots)), map(bool.__or__, stale, stale_swa))
        for i in changed:
            self.sync(slots[i], rows.page_tables[i], rows.swa_tables[i])

    def history_rows(self, slots: np.ndarray, columns: int, rows: int) -> np.ndarray:
        """[rows, columns]: row i = the history table of slots[i] (-1 past it and past len(slots))."""
        out = np.full((rows, columns), -1, np.int64)
        n = min(columns, self.history.shape[1])
        out[:len(slots), :n] = self.history[slots, :n]
        return out

    def swa_rows(self, slots: np.ndarray, first: np.ndarray, columns: int, rows: int) -> np.ndarray:
        """[rows, columns]: row i = the SWA table of slots[i] from logical page first[i] on."""
        return _gather(self.swa, slots, first, columns, rows)


def _update(table: np.ndarray, seen: list[list[int] | None], since: list[int], slot: int,
            values: list[int]) -> np.ndarray:
    """Make row `slot` of `table` (which holds seen[slot], then -1) hold `values`, then -1,
    writing from their first difference on; seen[slot] becomes a copy of `values` (never the
    caller's list: its owner changes it in place) and since[slot] that first difference.
    Returns the table (a wider one when `values` is longer than any row before)."""
    old = seen[slot]
    if old is None:                                   # never written: the row is all -1
        old = seen[slot] = []
    old_len = len(old)
    start = since[slot] = _take(old, values, since[slot])
    if len(values) > table.shape[1]:                  # a longer table than any before: grow
        grown = np.full((table.shape[0], max(len(values), 2 * table.shape[1])), -1, np.int64)
        grown[:, :table.shape[1]] = table
        table = grown
    table[slot, start:len(values)] = np.fromiter(islice(values, start, None), np.int64, len(values) - start)
    table[slot, len(values):old_len] = -1             # (a shorter table than the last one)
    return table


def _take(old: list[int], new: list[int], guess: int) -> int:
    """Make `old` a copy of `new`; return the length of the common prefix they had. `guess`:
    where it is looked for first. old[:guess] is compared with new[:guess] whole (old's tail
    replaced by new's, then one C-level comparison: nothing copied but that tail); then only
    the tails, or, when the heads differ, the heads, are searched (`_common_prefix`)."""
    h = min(guess, len(old), len(new))
    tail = old[h:]
    old[h:] = new[h:]
    if old == new:                                    # old[:h] == new[:h]: the difference is past h
        return h + _common_prefix(tail, new[h:])
    start = _common_prefix(old, new)                  # < h: old[:h] is still the old head
    old[start:] = new[start:]
    return start


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of `a` and `b`, by C-level comparisons of slices
    (no Python work per entry): the whole overlap first; when it differs, slices twice as long
    each time from the start, then halves of the one that differs: about three passes over the
    prefix (a difference at entry d costs O(d), not O(overlap))."""
    n = min(len(a), len(b))
    if _head(a, n) == _head(b, n):
        return n
    lo, hi = 0, min(64, n)
    while a[lo:hi] == b[lo:hi]:                       # a[:hi] == b[:hi]; the difference is past hi
        lo, hi = hi, min(2 * hi, n)
    while hi - lo > 1:                                # a[:lo] == b[:lo]; a[lo:hi] != b[lo:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _head(values: list[int], n: int) -> list[int]:
    """values[:n], without the copy when that is all of it."""
    return values if len(values) == n else values[:n]


def _gather(table: np.ndarray, slots: np.ndarray, first: np.ndarray, columns: int, rows: int) -> np.ndarray:
    out = np.full((rows, columns), -1, np.int64)
    col = first[:, None] + np.arange(columns)[None, :]
    inside = col < table.shape[1]
    out[:len(slots)] = np.where(inside, table[slots[:, None], np.minimum(col, table.shape[1] - 1)], -1)
    return out
