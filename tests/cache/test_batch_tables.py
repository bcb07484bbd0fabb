"""PersistentTables (cache/batch_tables.py): a synced row holds exactly its table, then -1, when
the table changed in any way since the last sync — grown by appending, a page swapped in the
middle with the length unchanged (before, at or after where the last write began), SWA pages
trimmed, shrunk, replaced by a new request's — and a table that only grew writes only its new
columns."""
import random

from dsv4.cache.batch_tables import PersistentTables, _common_prefix


def assert_rows_hold(tables: PersistentTables, slot: int, history: list[int], swa: list[int]) -> None:
    for table, values in ((tables.history, history), (tables.swa, swa)):
        assert table[slot, :len(values)].tolist() == values
        assert (table[slot, len(values):] == -1).all()


def test_a_grown_table_then_a_middle_swap_of_the_same_length_is_seen():
    tables, pages, swa = PersistentTables(3, columns=4), list(range(100, 140)), [5]
    tables.sync(1, pages, swa)
    pages.extend([200, 201])                 # grown by appending
    tables.sync(1, pages, swa)
    assert_rows_hold(tables, 1, pages, swa)
    pages[7] = 300                           # the prefix cache swaps a page: same length
    tables.sync(1, pages, swa)
    assert_rows_hold(tables, 1, pages, swa)
    pages[-1] = 301                          # a swap at the last column
    tables.sync(1, pages, swa)
    assert_rows_hold(tables, 1, pages, swa)


def test_a_swap_before_the_last_write_together_with_an_append_is_seen():
    tables, pages, swa = PersistentTables(2), list(range(1000, 1300)), []
    tables.sync(0, pages, swa)
    for i in range(20):
        pages.extend([2000 + i, 3000 + i])
        if i % 3 == 0:
            pages[i * 11] = 4000 + i         # below where the last write began
        tables.sync(0, pages, swa)
        assert_rows_hold(tables, 0, pages, swa)


def test_trimmed_and_grown_swa_tables_and_shrunk_tables():
    tables, pages, swa = PersistentTables(2), [1, 2, 3], list(range(10, 30))
    tables.sync(1, pages, swa)
    for step in range(1, 8):
        swa[:3 * step] = [-1] * (3 * step)   # trimmed in place, then grown
        swa.extend([100 + step, 200 + step])
        tables.sync(1, pages, swa)
        assert_rows_hold(tables, 1, pages, swa)
    shorter, swa2 = pages[:1], swa[:4]       # a new request whose tables are prefixes of the last ones
    tables.sync(1, shorter, swa2)
    assert_rows_hold(tables, 1, shorter, swa2)
    longer = shorter + [7, 8, 9, 10]
    tables.sync(1, longer, [])
    assert_rows_hold(tables, 1, longer, [])


def test_the_kept_copy_is_not_the_callers_list():
    tables, pages = PersistentTables(1), [5, 6, 7]
    tables.sync(0, pages, [])
    pages[0] = 9                             # changed in place after the sync: still seen
    tables.sync(0, pages, [])
    assert_rows_hold(tables, 0, pages, [])
    pages.append(10)
    pages[1] = 11
    tables.sync(0, pages, [])
    assert_rows_hold(tables, 0, pages, [])


def test_an_appended_table_writes_only_its_new_columns():
    tables, pages = PersistentTables(2), list(range(50, 90))
    tables.sync(1, pages, [])
    tables.history[1, 0] = 12345             # a column the next sync must not touch
    pages.extend([90, 91])
    tables.sync(1, pages, [])
    assert tables.history[1, 0] == 12345
    assert tables.history[1, 1:len(pages)].tolist() == pages[1:]
    writes = tables.writes
    tables.sync(1, list(pages), [])          # equal contents, another list: nothing written
    assert tables.writes == writes


def test_random_changes_keep_every_row_exact():
    rng, slots = random.Random(1), 4
    tables = PersistentTables(slots, columns=2)
    records = [([], []) for _ in range(slots)]
    for _ in range(600):
        slot = rng.randrange(slots)
        pages, swa = records[slot]
        change = rng.random()
        if change < 0.4:                                     # grow (a chunk)
            pages.extend(rng.randrange(10**6) for _ in range(rng.randint(0, 9)))
            swa.extend(rng.randrange(10**6) for _ in range(rng.randint(0, 9)))
        if 0.3 < change < 0.5 and pages:                     # a swap anywhere, the length kept
            pages[rng.randrange(len(pages))] = rng.randrange(10**6)
        if 0.45 < change < 0.7 and swa:                      # trim the front of the SWA table
            k = rng.randint(0, len(swa))
            swa[:k] = [-1] * k
        if 0.75 < change < 0.8 and pages:                    # an equal page id, another int object
            i = rng.randrange(len(pages))
            pages[i] = int(str(pages[i]))
        if 0.7 < change < 0.75:                              # shrink
            del pages[rng.randint(0, len(pages)):]
        if change > 0.9:                                     # a new request in the slot
            records[slot] = pages, swa = ([rng.randrange(10**6) for _ in range(rng.randint(0, 300))],
                                          [rng.randrange(10**6) for _ in range(rng.randint(0, 300))])
            if rng.random() < 0.5 and records[(slot + 1) % slots][0]:      # sharing the last pages' prefix
                pages[:0] = records[(slot + 1) % slots][0][:rng.randint(0, 50)]
        tables.sync(slot, pages, swa)
        for s, (p, w) in enumerate(records):
            if tables._seen_history[s] is not None:
                assert_rows_hold(tables, s, p, w)


def test_common_prefix_matches_a_plain_scan():
    rng = random.Random(2)
    for _ in range(400):
        n = rng.choice([0, 1, 2, 63, 64, 65, 200, 1000])
        a = [rng.randrange(3) for _ in range(n)]
        b = list(a[:rng.randint(0, n)]) + [rng.randrange(3) for _ in range(rng.randint(0, 70))]
        if rng.random() < 0.5 and b:
            b[rng.randrange(len(b))] = 7
        expect = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert _common_prefix(a, b) == _common_prefix(b, a) == expect
