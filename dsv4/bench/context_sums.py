"""Closed-form sums over context lengths, for the attention work of a prefill chunk.

A query whose context is c tokens (its own position + 1) sees min(c, W) sliding-window
keys, c // r compressed entries of ratio r, and the CSA top-k keeps min(k, c // 4) of them.
A chunk of n tokens starting after `start` tokens has contexts start+1 … start+n; these
functions sum such per-query counts over that range without a loop (prefills reach 1M).
"""
from __future__ import annotations


def sum_window(start: int, n: int, window: int) -> int:
    """Σ min(c, window) for c in (start, start + n]."""
    return _prefix_window(start + n, window) - _prefix_window(start, window)


def sum_entries(start: int, n: int, ratio: int) -> int:
    """Σ c // ratio for c in (start, start + n]."""
    return _prefix_entries(start + n, ratio) - _prefix_entries(start, ratio)


def sum_selected(start: int, n: int, ratio: int, topk: int) -> int:
    """Σ min(topk, c // ratio) for c in (start, start + n]."""
    return _prefix_selected(start + n, ratio, topk) - _prefix_selected(start, ratio, topk)


def _prefix_window(n: int, w: int) -> int:
    """Σ_{c=1..n} min(c, w)."""
    if n <= w:
        return n * (n + 1) // 2
    return w * (w + 1) // 2 + (n - w) * w


def _prefix_entries(n: int, r: int) -> int:
    """Σ_{c=1..n} c // r: each full block of r contexts [q*r, q*r + r) contributes q*r."""
    q = n // r
    return r * q * (q - 1) // 2 + q * (n - q * r + 1)


def _prefix_selected(n: int, r: int, k: int) -> int:
    """Σ_{c=1..n} min(k, c // r); c // r reaches k at c = k*r."""
    below = min(n, k * r - 1)
    return _prefix_entries(below, r) + max(0, n - below) * k
