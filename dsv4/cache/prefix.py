"""The prefix cache's index: a radix tree over 256-token pages (docs/architecture.md, "Cache").

A node stands for one history page of a token prefix: its key is the tokens of that page,
its path from the root the tokens before it, `page` the physical page holding the C4
entries, indexer keys and C128 entries of the page (closed groups are pure, so any request
with that prefix would have written the same). A node may hold a checkpoint slot: the
private state at its end L = 256 * depth (checkpoint.py), which is what makes a hit — a
request resumes at the deepest node of its prompt's path that has one.

Invariants:
  * the tree holds one reference to each node's page (`PageAllocator.mark_cached`);
  * every leaf has a checkpoint (a node with neither a checkpoint nor children is useless
    and is removed at once);
  * `_lru` lists every node, least recently used first, every node before its ancestors
    (each use touches the node, then its ancestors up to the root), so walking it from the
    front meets leaves first;
  * a request holding a tree page holds the whole path above it (the manager swaps a
    request's own copy of a page for the tree's), so a page only the tree holds heads a
    subtree only the tree holds: every reclaimable page can be evicted, leaves first.
This module is bookkeeping only: no tensors (the manager packs and restores checkpoints).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .layout import PAGE_TOKENS
from .pages import PageAllocator


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]                 # the page's tokens (empty at the root)
    parent: "Node | None"
    page: int                            # physical history page (-1 at the root)
    depth: int                           # pages from the root through this one
    children: dict = field(default_factory=dict)
    checkpoint: int | None = None        # checkpoint slot of the state at `end`
    attached: bool = True                # False once removed from the tree

    @property
    def end(self) -> int:
        return self.depth * PAGE_TOKENS

    def path(self) -> list["Node"]:
        """This node and its ancestors, root excluded, deepest first."""
        out, node = [], self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out


@dataclass(frozen=True)
class PrefixHit:
    node: Node                   # holds the checkpoint the request resumes from
    pages: list[int]             # history pages of positions [0, length)

    @property
    def length(self) -> int:
        return self.node.end


class PrefixTree:
    def __init__(self, pages: PageAllocator, num_checkpoints: int):
        self.alloc = pages
        self.root = Node((), None, -1, 0)
        self.num_checkpoints = num_checkpoints
        self._lru: OrderedDict[Node, None] = OrderedDict()
        self._ckpt_lru: OrderedDict[Node, None] = OrderedDict()   # nodes with a checkpoint, LRU first
        self._free_ckpts = list(range(num_checkpoints - 1, -1, -1))

    @property
    def num_pages(self) -> int:
        return len(self._lru)

    @property
    def num_checkpoints_used(self) -> int:
        return len(self._ckpt_lru)

    def pages(self) -> list[int]:
        return [node.page for node in self._lru]

    # ---- lookups ---------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int) -> PrefixHit | None:
        """The deepest node with a checkpoint on the path of `tokens`, ending at most at `limit`."""
        node, best = self.root, None
        for i in range(limit // PAGE_TOKENS):
            node = node.children.get(tuple(tokens[i * PAGE_TOKENS:(i + 1) * PAGE_TOKENS]))
            if node is None:
                break
            if node.checkpoint is not None:
                best = node
        if best is None:
            return None
        self._touch(best)
        self._ckpt_lru.move_to_end(best)
        return PrefixHit(best, [n.page for n in reversed(best.path())])

    def path_nodes(self, tokens: Sequence[int], num_pages: int) -> list[Node]:
        """The nodes of `tokens`' first `num_pages` pages the tree has, root's child first (no
        LRU change: the host / disk tiers look up how much of a prefix is here)."""
        node, out = self.root, []
        for i in range(num_pages):
            node = node.children.get(tuple(tokens[i * PAGE_TOKENS:(i + 1) * PAGE_TOKENS]))
            if node is None:
                break
            out.append(node)
        return out

    # ---- growing ---------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int], start: Node, depth: int
               ) -> tuple[Node, list[tuple[int, int]]]:
        """Nodes for pages [start.depth, depth) of `tokens` below `start` (a node on their path),
        new ones taking the request's `pages[i]` (the tree adds its reference). Returns the node at
        `depth` and the swaps [(i, tree page)] where the tree already had another page for page i:
        the request should hold the tree's instead."""
        node, swaps = start, []
        for i in range(start.depth, depth):
            key = tuple(tokens[i * PAGE_TOKENS:(i + 1) * PAGE_TOKENS])
            child = node.children.get(key)
            if child is None:
                child = Node(key, node, pages[i], i + 1)
                self.alloc.incref([pages[i]])
                self.alloc.mark_cached(pages[i])
                node.children[key] = child
                self._lru[child] = None
            elif child.page != pages[i]:
                swaps.append((i, child.page))
            node = child
        self._touch(node)
        return node, swaps

    def add_checkpoint(self, node: Node) -> int | None:
        """A checkpoint slot for `node` (the least recently used checkpoint gives up its own when
        none is free); None when it has one already or there are no slots."""
        if node.checkpoint is not None or not node.attached:
            return None
        if not self._free_ckpts and self._ckpt_lru:
            self.drop_checkpoint(next(iter(self._ckpt_lru)))
        if not self._free_ckpts or not node.attached:
            return None
        node.checkpoint = self._free_ckpts.pop()
        self._ckpt_lru[node] = None
        return node.checkpoint

    # ---- shrinking -------------------------------------------------------------------------
    def drop_checkpoint(self, node: Node) -> None:
        """Free the node's checkpoint; the node goes too when that leaves it useless."""
        if node.checkpoint is None:
            return
        self._free_ckpts.append(node.checkpoint)
        node.checkpoint = None
        del self._ckpt_lru[node]
        self._prune(node)

    def evict(self, n: int) -> int:
        """Free up to `n` pages only the tree holds, least recently used leaves first (a leaf's
        ancestors follow it once useless). Returns how many pages became free."""
        freed = 0
        for node in list(self._lru):
            if freed >= n:
                break
            if not node.attached or node.children or self.alloc.refcount(node.page) != 1:
                continue
            parent = node.parent
            freed += self._remove(node)
            freed += self._prune(parent)
        return freed

    def clear(self) -> int:
        """Drop every node and checkpoint; returns how many pages became free."""
        freed = 0
        for node in sorted(self._lru, key=lambda n: -n.depth):     # children before their parents
            freed += self._remove(node)
        return freed

    def _prune(self, node: Node) -> int:
        freed = 0
        while node.parent is not None and node.attached and not node.children and node.checkpoint is None:
            parent = node.parent
            freed += self._remove(node)
            node = parent
        return freed

    def _remove(self, node: Node) -> int:
        """Detach a node (its children must be gone) and drop the tree's page reference."""
        if node.checkpoint is not None:
            self._free_ckpts.append(node.checkpoint)
            node.checkpoint = None
            del self._ckpt_lru[node]
        del node.parent.children[node.key]
        del self._lru[node]
        node.attached = False
        return int(self.alloc.uncache(node.page))

    def _touch(self, node: Node) -> None:
        for n in node.path():              # deepest first: ancestors end up more recent
            self._lru.move_to_end(n)
