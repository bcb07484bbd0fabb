"""The prefix tree (dsv4/cache/prefix.py) and the allocator's cached pages (dsv4/cache/pages.py):
matching stops at the deepest checkpoint, every leaf has one, eviction is LRU over pages only
the tree holds, leaves first, and never takes a page a request holds."""
from __future__ import annotations

import pytest

from dsv4.cache.pages import PageAllocator
from dsv4.cache.prefix import PrefixTree

P = 256


def tokens(*pages: int) -> list[int]:
    """One page of 256 copies of each value given."""
    return [t for v in pages for t in [v] * P]


def grow(tree: PrefixTree, alloc: PageAllocator, toks: list[int], checkpoint_at: list[int]):
    """A request computing `toks`: its own pages, inserted with checkpoints at the given depths;
    returns its pages (after swaps) and the nodes of the checkpoints."""
    pages = alloc.allocate(len(toks) // P)
    nodes = []
    start = tree.root
    for depth in checkpoint_at:
        node, swaps = tree.insert(toks, pages, start, depth)
        for i, page in swaps:
            alloc.incref([page])
            alloc.free([pages[i]])
            pages[i] = page
        tree.add_checkpoint(node)
        nodes.append(node)
        start = node
    return pages, nodes


def test_cached_pages_are_reclaimable_only_when_the_tree_alone_holds_them():
    alloc = PageAllocator(4)
    a, b = alloc.allocate(2)
    alloc.incref([a])
    alloc.mark_cached(a)                 # a: request + tree
    assert alloc.num_reclaimable == 0
    alloc.free([a])                      # the request lets go
    assert alloc.num_reclaimable == 1 and alloc.refcount(a) == 1
    with pytest.raises(ValueError, match="use uncache"):
        alloc.free([a])                  # the tree's reference is dropped by uncache only
    alloc.incref([a])                    # a hit: pinned again
    assert alloc.num_reclaimable == 0
    alloc.free([a])
    assert alloc.uncache(a) is True and alloc.num_free == 3 and alloc.num_reclaimable == 0
    with pytest.raises(ValueError, match="does not hold"):
        alloc.uncache(b)


def test_match_returns_the_deepest_checkpoint_within_the_limit():
    alloc = PageAllocator(16)
    tree = PrefixTree(alloc, num_checkpoints=8)
    toks = tokens(1, 2, 3, 4)
    pages, nodes = grow(tree, alloc, toks, [1, 3])
    assert [n.end for n in nodes] == [256, 768]
    hit = tree.match(toks + [9] * 10, limit=len(toks) + 9)
    assert hit.length == 768 and hit.pages == pages[:3]
    assert tree.match(toks, limit=767).length == 256            # 768 would leave nothing to compute
    assert tree.match(tokens(1, 2, 7, 4), limit=1024).length == 256   # diverges on page 2
    assert tree.match(tokens(5, 2, 3), limit=768) is None
    assert tree.match(toks, limit=255) is None
    assert tree.num_pages == 3, "page 3 (after the last checkpoint) is not inserted"


def test_every_leaf_keeps_a_checkpoint_and_useless_nodes_go():
    alloc = PageAllocator(16)
    tree = PrefixTree(alloc, num_checkpoints=8)
    pages, (low, high) = grow(tree, alloc, tokens(1, 2, 3), [1, 3])
    alloc.free(pages)                                  # the request finished
    assert alloc.num_reclaimable == 3
    tree.drop_checkpoint(high)                         # leaf without a checkpoint: it and page 1 go
    assert tree.num_pages == 1 and not high.attached and low.attached
    assert alloc.num_free == 15 and alloc.num_reclaimable == 1
    tree.drop_checkpoint(low)
    assert tree.num_pages == 0 and alloc.num_free == 16


def test_checkpoint_pool_evicts_its_least_recently_used():
    alloc = PageAllocator(16)
    tree = PrefixTree(alloc, num_checkpoints=2)
    a, (na,) = grow(tree, alloc, tokens(1), [1])
    b, (nb,) = grow(tree, alloc, tokens(2), [1])
    tree.match(tokens(1) + [0], limit=257)             # a is used again: b is now the oldest
    c, (nc,) = grow(tree, alloc, tokens(3), [1])
    assert na.checkpoint is not None and nc.checkpoint is not None
    assert not nb.attached, "the least recently used checkpoint and its useless node went"
    assert alloc.refcount(b[0]) == 1, "the request still holds its page"
    assert sorted(n.checkpoint for n in (na, nc)) == [0, 1]


def test_eviction_is_lru_leaves_first_and_skips_pages_in_use():
    alloc = PageAllocator(8)
    tree = PrefixTree(alloc, num_checkpoints=8)
    old, _ = grow(tree, alloc, tokens(1, 2), [1, 2])
    new, _ = grow(tree, alloc, tokens(3, 4), [2])
    used, _ = grow(tree, alloc, tokens(5), [1])
    alloc.free(old)
    alloc.free(new)                                    # `used` is still running
    assert alloc.num_reclaimable == 4 and alloc.num_free == 3
    assert tree.evict(1) == 1
    assert alloc.refcount(old[1]) == 0 and alloc.refcount(old[0]) == 1, "the oldest leaf goes first"
    assert tree.evict(10) == 3
    assert tree.num_pages == 1 and alloc.refcount(used[0]) == 2, "a page a request holds is never evicted"
    assert alloc.num_free == 7


def test_insert_reports_pages_the_tree_already_has():
    alloc = PageAllocator(8)
    tree = PrefixTree(alloc, num_checkpoints=4)
    first, _ = grow(tree, alloc, tokens(1, 2), [2])
    twin = alloc.allocate(3)
    node, swaps = tree.insert(tokens(1, 2, 3), twin, tree.root, 3)
    assert swaps == [(0, first[0]), (1, first[1])] and node.page == twin[2]
    assert node.parent.page == first[1]


def test_clear_frees_every_page_only_the_tree_holds():
    alloc = PageAllocator(8)
    tree = PrefixTree(alloc, num_checkpoints=4)
    done, _ = grow(tree, alloc, tokens(1, 2), [1, 2])
    running, _ = grow(tree, alloc, tokens(1, 2, 3), [3])
    alloc.free(done)
    assert tree.clear() == 0 and alloc.num_free == 5, "every page is still held by the running request"
    assert tree.num_pages == 0 and alloc.num_reclaimable == 0
    assert [alloc.refcount(p) for p in running] == [1, 1, 1]
    alloc.free(running)
    assert alloc.num_free == 8
