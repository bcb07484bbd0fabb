import pytest

from dsv4.cache.pages import OutOfPages, PageAllocator


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
