"""PageAllocator (cache/pages.py). Every test runs twice: lists of pages handled one page at a
time and in numpy (`_FEW` 0); both give the same results, errors and free-list order."""
import random

import pytest

from dsv4.cache import pages as pages_module
from dsv4.cache.pages import OutOfPages, PageAllocator


@pytest.fixture(autouse=True, params=["one at a time", "numpy"])
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(pages_module, "_FEW", 0)
    return request.param


def test_alloc_free_round_trip_restores_free_count():
    alloc = PageAllocator(8)
    first = alloc.allocate(3)
    second = alloc.allocate(5)
    assert first == [0, 1, 2] and second == [3, 4, 5, 6, 7]
    assert (alloc.num_free, alloc.num_used) == (0, 8)
    assert all(alloc.refcount(p) == 1 for p in first + second)

    assert alloc.free(first) == first
    assert alloc.free(second) == second
    assert (alloc.num_free, alloc.num_used) == (8, 0)
    assert all(alloc.refcount(p) == 0 for p in range(8))


def test_freed_pages_are_reused_in_release_order():
    alloc = PageAllocator(4)
    pages = alloc.allocate(4)
    alloc.free([pages[2]])
    alloc.free([pages[0]])
    assert alloc.allocate(2) == [2, 0]


def test_sharing_via_incref_keeps_page_until_last_owner_frees():
    alloc = PageAllocator(4)
    [page] = alloc.allocate(1)
    alloc.incref([page])
    alloc.incref([page])
    assert alloc.refcount(page) == 3

    assert alloc.free([page]) == []
    assert alloc.free([page]) == []
    assert alloc.num_used == 1 and alloc.refcount(page) == 1
    assert alloc.free([page]) == [page]
    assert alloc.num_free == 4


def test_page_listed_twice_counts_twice():
    alloc = PageAllocator(2)
    [page] = alloc.allocate(1)
    alloc.incref([page, page])
    assert alloc.refcount(page) == 3
    assert alloc.free([page, page, page]) == [page]


def test_double_free_is_detected_and_changes_nothing():
    alloc = PageAllocator(4)
    a, b = alloc.allocate(2)
    alloc.free([a])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([a])
    # b is listed once, a is already free: the whole call fails, b keeps its owner.
    with pytest.raises(ValueError, match="double free"):
        alloc.free([b, a])
    assert alloc.refcount(b) == 1 and alloc.num_free == 3
    with pytest.raises(ValueError, match="double free"):
        alloc.free([b, b])
    assert alloc.refcount(b) == 1


def test_allocation_is_all_or_nothing():
    alloc = PageAllocator(5)
    alloc.allocate(3)
    assert alloc.can_allocate(2) and not alloc.can_allocate(3)
    with pytest.raises(OutOfPages) as err:
        alloc.allocate(3)
    assert isinstance(err.value, RuntimeError)
    assert (err.value.requested, err.value.free) == (3, 2)
    assert alloc.num_free == 2
    assert alloc.allocate(2) == [3, 4]
    assert alloc.allocate(0) == []


def test_invalid_ids_and_counts_are_rejected():
    alloc = PageAllocator(2)
    with pytest.raises(ValueError):
        alloc.allocate(-1)
    with pytest.raises(ValueError):
        alloc.free([2])
    with pytest.raises(ValueError):
        alloc.refcount(-1)
    with pytest.raises(ValueError, match="free page"):
        alloc.incref([0])
    assert not alloc.can_allocate(-1)


def test_bulk_free_returns_released_pages_in_listed_order_and_reuses_them_fifo():
    alloc = PageAllocator(3600)
    pages = alloc.allocate(3600)
    shared = pages[100:200]
    alloc.incref(shared)                     # still owned once more after the free
    order = pages[:]
    random.Random(0).shuffle(order)
    released = alloc.free(order)
    assert released == [p for p in order if p not in set(shared)]
    assert alloc.num_free == 3500 and all(alloc.refcount(p) == 1 for p in shared)
    assert alloc.allocate(5) == released[:5]
    assert alloc.free(shared) == shared


def test_bulk_free_of_repeated_pages_counts_each_listing():
    alloc = PageAllocator(64)
    pages = alloc.allocate(40)
    alloc.incref(pages[:10] + pages[:10])    # refcount 3 for the first ten
    assert all(alloc.refcount(p) == 3 for p in pages[:10])
    listed = pages[20:] + pages[:10] + pages[:10] + pages[10:20] + pages[5:10]
    released = alloc.free(listed)
    assert released == pages[20:] + pages[5:10] + pages[10:20]     # first-listing order
    assert [alloc.refcount(p) for p in pages[:10]] == [1] * 5 + [0] * 5
    assert alloc.num_free == 24 + 35
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages[:5] * 2 + [pages[0]] * 20)


def test_failed_bulk_calls_change_nothing():
    alloc = PageAllocator(64)
    pages = alloc.allocate(40)
    alloc.mark_cached(pages[35])
    before = (alloc.num_free, alloc.num_reclaimable, [alloc.refcount(p) for p in range(64)], list(alloc._free_list))
    for bad, error in [(pages[:30] + [64], "outside"), (pages[:30] + [-1], "outside"),
                       (pages[:30] + [50], "double free"), (pages[:30] + [pages[7]], "double free"),
                       (pages[:30] + [pages[35]], "prefix cache"), ([50] + pages[:30] + [64], "double free"),
                       ([64] + pages[:30] + [50], "outside")]:
        with pytest.raises(ValueError, match=error):
            alloc.free(bad)
        assert (alloc.num_free, alloc.num_reclaimable, [alloc.refcount(p) for p in range(64)],
                list(alloc._free_list)) == before
    for bad, error in [(pages[:30] + [50], "free page"), (pages[:30] + [99], "outside"),
                       ([55] + pages[:30] + [99], "free page")]:
        with pytest.raises(ValueError, match=error):
            alloc.incref(bad)
        assert [alloc.refcount(p) for p in range(64)] == before[2]


def test_bulk_calls_keep_num_reclaimable():
    alloc = PageAllocator(64)
    pages = alloc.allocate(40)
    for p in pages[:20]:
        alloc.mark_cached(p)                 # the request's reference becomes the tree's
    assert alloc.num_reclaimable == 20
    alloc.incref(pages[:30])                 # a request holds them: not reclaimable
    assert alloc.num_reclaimable == 0
    alloc.incref(pages[:5])                  # refcount 3
    assert alloc.free(pages[:30]) == []
    assert alloc.num_reclaimable == 15
    assert alloc.free(pages[:5] + pages[20:]) == pages[20:]
    assert alloc.num_reclaimable == 20
    assert all(alloc.uncache(p) for p in pages[:20]) and alloc.num_free == 64


def test_random_operations_agree_one_at_a_time_and_in_numpy(monkeypatch):
    rng = random.Random(3)
    allocs = {few: PageAllocator(300) for few in (10**9, 0)}
    held: list[int] = []
    for _ in range(400):
        op = rng.choice(["allocate", "incref", "free", "free", "cache", "uncache"])
        if op == "allocate":
            arg = rng.randint(0, 40)
        elif op in ("incref", "free"):
            arg = [rng.choice(held) if held and rng.random() < 0.97 else rng.randrange(-2, 303)
                   for _ in range(rng.randint(0, 60))]
        else:
            arg = rng.choice(held) if held else 0
        results = []
        for few, alloc in allocs.items():
            monkeypatch.setattr(pages_module, "_FEW", few)
            try:
                out = {"allocate": alloc.allocate, "incref": alloc.incref, "free": alloc.free,
                       "cache": alloc.mark_cached, "uncache": alloc.uncache}[op](arg)
            except (ValueError, OutOfPages) as e:
                out = repr(e)
            results.append((out, alloc.num_free, alloc.num_reclaimable, list(alloc._free_list),
                            [alloc.refcount(p) for p in range(300)], [alloc.is_cached(p) for p in range(300)]))
        assert results[0] == results[1], op
        if op == "allocate" and isinstance(results[0][0], list):
            held += results[0][0]
        held = [p for p in held if allocs[0].refcount(p) > 0]
