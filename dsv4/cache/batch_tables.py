"""The running requests' page tables kept between steps (docs/architecture.md, "Cache").

One row per request state slot, in two pre-allocated arrays (history pages, SWA pages; -1 past
a table's end). Before a step each scheduled request's row is synced with its record: a row is
rewritten only when its table changed (a C-level list comparison against the copy taken at the
last write), so a decode step copies no table; any change — pages appended, shared pages swapped
in by the prefix cache, SWA pages trimmed, a new request in the slot — is seen. `sync_rows`
makes those comparisons for a whole step in C-level maps, calling Python only for the rows that
changed (a few a step: a page boundary crossed, a new request). `build_step` then gathers the
step's tables from the rows in a few vectorised operations (`history_rows`, `swa_rows`), the
same tables `_table` builds from the lists.
"""
from __future__ import annotations

from itertools import compress
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
        self.writes = 0                 # rows rewritten so far (how incremental the updates are)

    def sync(self, slot: int, history: list[int], swa: list[int]) -> None:
        """Make row `slot` hold these tables."""
        if history != self._seen_history[slot]:
            self.history = _write(self.history, slot, history)
            self._seen_history[slot] = list(history)
            self.writes += 1
        if swa != self._seen_swa[slot]:
            self.swa = _write(self.swa, slot, swa)
            self._seen_swa[slot] = list(swa)
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


def _write(table: np.ndarray, slot: int, values: list[int]) -> np.ndarray:
    if len(values) > table.shape[1]:                  # a longer table than any before: grow
        grown = np.full((table.shape[0], max(len(values), 2 * table.shape[1])), -1, np.int64)
        grown[:, :table.shape[1]] = table
        table = grown
    table[slot] = -1
    table[slot, :len(values)] = values
    return table


def _gather(table: np.ndarray, slots: np.ndarray, first: np.ndarray, columns: int, rows: int) -> np.ndarray:
    out = np.full((rows, columns), -1, np.int64)
    col = first[:, None] + np.arange(columns)[None, :]
    inside = col < table.shape[1]
    out[:len(slots)] = np.where(inside, table[slots[:, None], np.minimum(col, table.shape[1] - 1)], -1)
    return out
