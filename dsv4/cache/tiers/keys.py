"""Cumulative hash-chain keys of 256-token pages (docs/architecture.md, "Host and disk tiers").

Page k's key hashes the layout signature and the tokens of pages 0..k (key_k = H(key_{k-1} ||
tokens of page k), key_{-1} = H(signature)), so one key names a whole prefix: a key found in a
tier means the same history as the GPU prefix tree's node at depth k + 1, and a checkpoint tail
stored under key_k is the state at L = 256 (k + 1).
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from ..layout import PAGE_TOKENS

Key = bytes        # 32 bytes (sha256)


def root_key(signature: str) -> Key:
    return hashlib.sha256(b"dsv4-tier\0" + signature.encode()).digest()


def chain_keys(root: Key, tokens: Sequence[int], num_pages: int, known: Sequence[Key] = ()) -> list[Key]:
    """key_0 .. key_{num_pages - 1} of `tokens` (which hold at least num_pages whole pages);
    `known`: keys of its first pages computed before (only the pages after them are hashed)."""
    keys = list(known[:num_pages])
    extend_chain(root, tokens, keys, num_pages)
    return keys


def extend_chain(root: Key, tokens: Sequence[int], keys: list[Key], num_pages: int) -> None:
    """Append to `keys` (key_0 .. key_{k-1} of `tokens`) the keys of pages k .. num_pages - 1, in
    place: only the new pages are hashed and nothing is copied (nothing is done if k >= num_pages)."""
    if len(tokens) < num_pages * PAGE_TOKENS:
        raise ValueError(f"{len(tokens)} tokens hold fewer than {num_pages} pages")
    first = len(keys)
    if first >= num_pages:
        return
    data = memoryview(array("q", tokens[first * PAGE_TOKENS:num_pages * PAGE_TOKENS]).tobytes())
    step, prev = PAGE_TOKENS * 8, keys[-1] if keys else root
    for k in range(num_pages - first):
        h = hashlib.sha256(prev)
        h.update(data[k * step:(k + 1) * step])
        prev = h.digest()
        keys.append(prev)
