"""Which pages and state slot each request holds (docs/architecture.md, "Cache").

The manager owns the per-request records (`SeqCache`, keyed by request id); requests hold
nothing of the cache. A request running a step over positions [n, n + k) must hold:
  * history pages for logical pages 0 .. (n + k - 1) // 256;
  * SWA pages for logical pages from (n - W - S) // 128 to (n + k - 1) // 128 (older ones
    are freed after each step: positions below n - W - S are never read again);
  * a state slot (its compressor ring rows).
`reserve` takes all of it or nothing. A request is anything with `request_id` and
`num_computed` (tokens whose KV is written); the prefix cache also reads its tokens
(`prompt_token_ids`, `output_token_ids`, `known_tokens`, `num_tokens`, `wants_prompt_logprobs`).

With a prefix cache (prefix.py, checkpoint.py; `bind` gives the storage it packs into):
  * `match` finds the deepest checkpointed page boundary L of a waiting request's tokens and
    `admit` resumes it there: the hit's pages shared (one more reference each), the
    checkpoint copied into its own SWA pages and ring slot, num_computed = L;
  * `stage` marks the last page boundary L inside a chunk, whose overlap rows the step then
    also writes to the request's staging ring rows (cache/addressing.py); `commit`, after the
    step, inserts the request's pages up to the page boundary L its computed tokens reached and
    checkpoints L: SWA keys from its SWA pages (not trimmed yet), overlap rows from the staging
    rows, or from the ring by position while they are still there (decode steps);
  * pages only the tree holds count as available: `reserve` evicts them (LRU) when the free
    list runs short; `release` leaves the tree's references alone.

With host / disk tiers (cache/tiers/, given to `bind`): every checkpoint `commit` takes is also
offloaded; `waits_for_tiers` restores a deeper prefix than the GPU's hit into the tree before
admission (the request waits while the copy runs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..model.vision.spans import resume_limit
from .checkpoint import OVERLAP
from .layout import PAGE_TOKENS, SWA_PAGE_TOKENS, CacheLayout, CachePlan
from .pages import PageAllocator
from .prefix import Node, PrefixHit, PrefixTree


@dataclass
class SeqCache:
    pages: list[int] = field(default_factory=list)       # logical 256-token page -> physical
    swa_pages: list[int] = field(default_factory=list)   # logical 128-token SWA page -> physical or -1
    slot: int | None = None                              # request state slot: its ring rows
    committed: int = 0                   # page boundaries up to here are in the prefix tree (or were tried)
    staged: int = 0                      # the boundary whose overlap rows its staging ring rows hold
    node: Node | None = None             # the tree node at `committed`
    decode_node: Node | None = None      # the checkpoint it took past its prompt (replaced by the next one)
    trimmed: int = 0                     # SWA pages below this logical page are freed (-1); `reserve` never
                                         # takes one there again: num_computed only grows while the record lives

    @property
    def holds_nothing(self) -> bool:
        return not self.pages and not any(p >= 0 for p in self.swa_pages) and self.slot is None


class CacheManager:
    def __init__(self, layout: CacheLayout, plan: CachePlan, prefix_caching: bool = False):
        self.layout, self.plan = layout, plan
        self.swa_keep = layout.swa_keep  # W + S (the layout is frozen; read per request and step)
        self.pages = PageAllocator(plan.num_pages)
        self.swa = PageAllocator(plan.num_swa_pages)
        self.free_slots = list(range(plan.max_num_seqs - 1, -1, -1))
        self.seqs: dict[str, SeqCache] = {}
        self.prefix = PrefixTree(self.pages, plan.num_checkpoints) if prefix_caching and plan.num_checkpoints else None
        self.storage = None
        self.tiers = None                # host / disk tiers (cache/tiers/), when configured

    def bind(self, storage, tiers=None) -> None:
        """The KVStorage whose rows checkpoints are packed from and restored into; `tiers`
        (a cache.tiers.TierOptions) adds the host and disk tiers behind the prefix cache."""
        if self.prefix is not None and storage.checkpoint_format is None:
            raise ValueError("prefix caching needs a storage with checkpoint slots")
        self.storage = storage
        if tiers is not None and self.prefix is not None:
            from .tiers import KVTiers
            self.tiers = KVTiers(tiers, storage, self.pages, self.prefix)

    def seq(self, req) -> SeqCache:
        """The request's record (an empty one, not stored, when it holds nothing)."""
        return self.seqs.get(req.request_id) or SeqCache()

    # ---- reserving -------------------------------------------------------------------------
    def _needs(self, req, num_new: int, held: SeqCache) -> tuple[int, list[int]]:
        """(history pages to allocate, logical SWA pages to allocate) for [num_computed, + num_new)."""
        end = req.num_computed + num_new
        history = max(0, -(-end // PAGE_TOKENS) - len(held.pages))
        first = max(0, req.num_computed - self.swa_keep) // SWA_PAGE_TOKENS
        last = (end - 1) // SWA_PAGE_TOKENS
        swa_pages = held.swa_pages
        if first <= last < len(swa_pages) and min(swa_pages[first:last + 1]) >= 0:
            return history, []          # every SWA page held already (a decode step, mostly): checked in C
        swa = [p for p in range(first, last + 1) if p >= len(swa_pages) or swa_pages[p] < 0]
        return history, swa

    def available_pages(self) -> int:
        """Free history pages plus those only the prefix cache holds (evicted on demand)."""
        return self.pages.num_free + (self.pages.num_reclaimable if self.prefix is not None else 0)

    def can_reserve(self, req, num_new: int) -> bool:
        held = self.seq(req)
        return self._fits(held, *self._needs(req, num_new, held))

    def _fits(self, held: SeqCache, history: int, swa: list[int]) -> bool:
        return (history <= self.available_pages() and self.swa.can_allocate(len(swa))
                and (held.slot is not None or bool(self.free_slots)))

    def reserve(self, req, num_new: int) -> bool:
        """Hold everything positions [num_computed, num_computed + num_new) need; all or nothing."""
        held = self.seqs.get(req.request_id)
        if held is not None and held.slot is not None:      # `_needs` == (0, []) inlined: a decode
            start, swa_pages = req.num_computed, held.swa_pages       # step inside its pages, mostly
            end = start + num_new
            first = (start - self.swa_keep) // SWA_PAGE_TOKENS if start > self.swa_keep else 0
            last = (end - 1) // SWA_PAGE_TOKENS
            if (end <= len(held.pages) * PAGE_TOKENS and first <= last < len(swa_pages)
                    and min(swa_pages[first:last + 1]) >= 0):
                return True             # holds it all already
        held = held or SeqCache()
        history, swa = self._needs(req, num_new, held)
        if not history and not swa and held.slot is not None:
            return True                 # holds it all already (a decode step inside its pages)
        if not self._fits(held, history, swa):
            return False
        if history > self.pages.num_free:
            self.prefix.evict(history - self.pages.num_free)
            if history > self.pages.num_free:
                return False
        held = self.seqs.setdefault(req.request_id, held)
        if held.slot is None:
            held.slot = self.free_slots.pop()
        held.pages.extend(self.pages.allocate(history))
        for logical, phys in zip(swa, self.swa.allocate(len(swa))):
            held.swa_pages.extend([-1] * (logical + 1 - len(held.swa_pages)))
            held.swa_pages[logical] = phys
        return True

    def trim(self, req) -> None:
        """Free SWA pages wholly below num_computed - W - S."""
        held = self.seqs.get(req.request_id)
        if held is None:
            return
        behind = req.num_computed - self.swa_keep
        keep_from = behind // SWA_PAGE_TOKENS if behind > 0 else 0
        if keep_from <= held.trimmed:
            return          # nothing newly behind the window (pages are never taken below `trimmed`)
        self.swa.free([p for p in held.swa_pages[:keep_from] if p >= 0])
        held.swa_pages[:keep_from] = [-1] * min(keep_from, len(held.swa_pages))
        held.trimmed = keep_from

    def settle(self, reqs: list) -> None:
        """`commit` then `trim` each of a step's requests (their num_computed advanced)."""
        commit = self.commit if self.prefix is not None else None
        for req in reqs:
            if commit is not None:
                commit(req)
            self.trim(req)

    def release(self, req) -> None:
        """Free everything the request holds (finish, abort, preemption); the prefix cache keeps
        its own references to the pages it shares."""
        if self.tiers is not None:
            self.tiers.forget(req.request_id)
        held = self.seqs.pop(req.request_id, None)
        if held is None:
            return
        self.pages.free(held.pages)
        self.swa.free([p for p in held.swa_pages if p >= 0])
        if held.slot is not None:
            self.free_slots.append(held.slot)

    def fits_ever(self, num_tokens: int, chunk: int) -> bool:
        """Could a request of `num_tokens` tokens run alone (chunks of `chunk` tokens)?"""
        swa_needed = self.layout.swa_pages_needed(1, chunk)
        return -(-num_tokens // PAGE_TOKENS) <= self.plan.num_pages and swa_needed <= self.plan.num_swa_pages

    def usage(self) -> dict:
        tree = self.prefix
        return {"pages_used": self.pages.num_used, "pages_total": self.plan.num_pages,
                "swa_pages_used": self.swa.num_used, "swa_pages_total": self.plan.num_swa_pages,
                "slots_used": self.plan.max_num_seqs - len(self.free_slots),
                "prefix_pages": tree.num_pages if tree else 0,
                "prefix_checkpoints": tree.num_checkpoints_used if tree else 0,
                **(self.tiers.usage() if self.tiers is not None else {})}

    # ---- the prefix cache ------------------------------------------------------------------
    def match(self, req) -> PrefixHit | None:
        """The deepest checkpoint a request that holds nothing could resume from (None for a
        request that wants prompt logprobs: it computes every prompt position)."""
        limit = self._match_limit(req)
        if limit is None:
            return None
        hit = self.prefix.match(req.key_tokens(0, limit // PAGE_TOKENS * PAGE_TOKENS), limit)
        while hit is not None and resume_limit(req.images, hit.length) < hit.length:   # inside an image
            limit = resume_limit(req.images, hit.length)
            hit = self.prefix.match(req.key_tokens(0, limit // PAGE_TOKENS * PAGE_TOKENS), limit)
        return hit

    def peek(self, req) -> int:
        """The tokens a waiting request would resume from here (the deepest checkpoint of its
        path outside an image block; 0: none), as a pure lookup: no LRU change, no reference
        taken. Data-parallel placement compares the ranks' trees with it (engine/data_parallel.py)."""
        limit = self._match_limit(req)
        if limit is None:
            return 0
        tokens = req.key_tokens(0, limit // PAGE_TOKENS * PAGE_TOKENS)
        return max((n.end for n in self.prefix.path_nodes(tokens, limit // PAGE_TOKENS)
                    if n.checkpoint is not None and resume_limit(req.images, n.end) == n.end), default=0)

    def _match_limit(self, req) -> int | None:
        """How far a waiting request may resume (None: it may not)."""
        if self.prefix is None or req.num_computed or req.wants_prompt_logprobs or req.request_id in self.seqs:
            return None
        known = len(req.prompt_token_ids) + len(req.output_token_ids)
        limit = min(known, req.num_tokens - 1)          # at least one token is left to compute
        return limit if limit >= PAGE_TOKENS else None

    def waits_for_tiers(self, req) -> bool:
        """Restore from the host / disk tiers a deeper prefix of a waiting request than the GPU
        prefix cache holds; True while that copy runs (admit it later). Requests that want prompt
        logprobs never load (`_match_limit`)."""
        limit = self._match_limit(req) if self.tiers is not None else None
        if limit is None:
            return False
        limit = resume_limit(req.images, limit)         # never inside an image block
        tokens = req.key_tokens(0, limit // PAGE_TOKENS * PAGE_TOKENS)
        path = self.prefix.path_nodes(tokens, limit // PAGE_TOKENS)
        gpu = max((n.end for n in path if n.checkpoint is not None), default=0)
        return self.tiers.fetch(tokens, limit, gpu, req.request_id)

    def wait_for_tiers(self, timeout: float = 2e-3) -> None:
        """Nothing to run this step: block briefly on the tiers' copies in flight, if any
        (KVTiers.wait_briefly)."""
        if self.tiers is not None and self.tiers.busy:
            self.tiers.wait_briefly(timeout)

    def poll_tiers(self) -> None:
        """Collect the tiers' finished copies (once a step, before admission)."""
        if self.tiers is not None:
            self.tiers.poll()

    def admit(self, req, hit: PrefixHit, num_new: int) -> bool:
        """Resume `req` at hit.length and reserve [L, L + num_new); all or nothing."""
        L = hit.length
        self.pages.incref(hit.pages)                    # pinned first: eviction cannot take them
        self.seqs[req.request_id] = held = SeqCache(pages=list(hit.pages), committed=L, node=hit.node)
        req.num_computed = L
        if not self.reserve(req, num_new):
            self.pages.free(self.seqs.pop(req.request_id).pages)
            req.num_computed = 0
            return False
        fmt = self.storage.checkpoint_format
        fmt.unpack(self.storage, self.storage.checkpoints[hit.node.checkpoint], held.swa_pages, held.slot, L)
        return True

    def stage(self, req, start: int, num_tokens: int) -> int:
        """The page boundary whose overlap rows a chunk [start, start + num_tokens) should stage:
        the last one before its last token (a resend of a prompt ending on a boundary resumes
        one page earlier; the boundary at the chunk's end is taken from the ring), when the
        chunk computes all of [L - 4, L); 0 for none."""
        held = self.seqs.get(req.request_id)
        L = (start + num_tokens - 1) // PAGE_TOKENS * PAGE_TOKENS
        if self.prefix is None or held is None or L - OVERLAP < start or L <= held.committed:
            return 0
        held.staged = L
        return L

    def commit(self, req) -> None:
        """After a step: share the request's pages up to the page boundaries its known, computed
        tokens reached (the staged one and the last one) and checkpoint them while their private
        rows are still in place."""
        if self.prefix is None:
            return
        held = self.seqs.get(req.request_id)
        if held is None:
            return
        known = len(req.prompt_token_ids) + len(req.output_token_ids)
        top = min(req.num_computed, known) // PAGE_TOKENS * PAGE_TOKENS
        if top <= held.committed:
            return                      # no boundary in (committed, top]: most steps
        for L in sorted({held.staged, top}):
            if held.committed < L <= top:
                held.committed = L
                self._checkpoint(req, held, L)

    def _checkpoint(self, req, held: SeqCache, L: int) -> None:
        staged = held.staged == L
        if not self._swa_held(held, L) or not (staged or self._ring_holds(req.num_computed, L)):
            return
        tokens = req.key_tokens(0, L)
        node = self._insert(held, tokens, L)
        slot = self.prefix.add_checkpoint(node)
        if slot is None:
            return
        fmt = self.storage.checkpoint_format
        fmt.pack(self.storage, held.swa_pages, held.slot, L, self.storage.checkpoints[slot], staged)
        if self.tiers is not None:
            self.tiers.offload(tokens, held.pages[:L // PAGE_TOKENS], L, self.storage.checkpoints[slot],
                               req.request_id)
        if L > len(req.prompt_token_ids):               # past the prompt: only the latest is kept
            old, held.decode_node = held.decode_node, node
            if old is not None and old.attached and old is not node:
                self.prefix.drop_checkpoint(old)

    def reset_prefix(self) -> int:
        """Forget every cached prefix (pages in use stay with their requests); pages freed."""
        if self.prefix is None:
            return 0
        for held in self.seqs.values():
            held.node = held.decode_node = None
        return self.prefix.clear()

    def _ring_holds(self, n: int, L: int) -> bool:
        """Does the ring still hold positions [L - 4, L) when n positions are written? It keeps
        the last csa_ring."""
        return n - (L - OVERLAP) <= self.layout.csa_ring

    def _swa_held(self, held: SeqCache, L: int) -> bool:
        """Are the SWA pages of [L - W, L) still held (not trimmed)?"""
        first, last = (L - self.layout.cfg.sliding_window) // SWA_PAGE_TOKENS, (L - 1) // SWA_PAGE_TOKENS
        return last < len(held.swa_pages) and all(held.swa_pages[p] >= 0 for p in range(first, last + 1))

    def _insert(self, held: SeqCache, tokens: list[int], L: int) -> Node:
        """Tree nodes for the request's pages [0, L / 256); where the tree has its own page for
        one, the request switches to it (same contents: closed groups are pure)."""
        start = held.node if held.node is not None and held.node.attached else self.prefix.root
        node, swaps = self.prefix.insert(tokens, held.pages, start, L // PAGE_TOKENS)
        for i, page in swaps:
            self.pages.incref([page])
            self.pages.free([held.pages[i]])
            held.pages[i] = page
        held.node = node
        return node
