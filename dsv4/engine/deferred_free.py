"""Long token lists of ended requests, freed a slice at a time between steps (docs/architecture.md,
"Engine": host work per step).

A prompt is a list of int objects; freeing one of 920k tokens (a decref and a deallocation per
int) takes 10-30 ms of the host, and where its last reference dies is wherever the engine last
dropped the request: inside a step, stalling every other request's. The engine core hands the
prompt of each request that ends to `DeferredFree.hold`; the list then outlives every other
reference, and `release` (after each launch, while the device runs the step) frees at most
`per_step` of its ints, only from lists nothing else references any more: their contents are
never changed under another owner. When the engine has nothing to run, `release_all` frees the rest.
"""
from __future__ import annotations

import sys

MIN_TOKENS = 1 << 16     # shorter lists are left to die where they die (well under a millisecond)
PER_STEP = 1 << 15       # ints freed after a launch (under 1 ms on the CPU host)


def _refs(held: list[list[int]], i: int) -> int:
    """The references to held[i], as counted from here (the count includes this call's own)."""
    return sys.getrefcount(held[i])


_ONLY_HELD = _refs([[0]], 0)     # the count of a list the holder alone references


class DeferredFree:
    def __init__(self, min_tokens: int = MIN_TOKENS, per_step: int = PER_STEP):
        self.min_tokens, self.per_step = min_tokens, per_step
        self._held: list[list[int]] = []

    def hold(self, tokens: list[int]) -> None:
        """Keep `tokens` alive until `release` frees it (lists shorter than min_tokens: not kept)."""
        if len(tokens) >= self.min_tokens:
            self._held.append(tokens)

    def release(self, budget: int | None = None) -> int:
        """Free up to `budget` (default per_step) ints of the lists only this holds, from their
        ends; -> how many. A list someone else still references waits for a later call."""
        budget = self.per_step if budget is None else budget
        freed, i, held = 0, 0, self._held
        while i < len(held) and freed < budget:
            if _refs(held, i) == _ONLY_HELD:
                tokens = held[i]
                n = min(budget - freed, len(tokens))
                del tokens[len(tokens) - n:]
                freed += n
                if not tokens:
                    del held[i]
                    continue
            i += 1
        return freed

    def release_all(self) -> int:
        """Free every list only this holds (the engine has nothing to run: nobody waits)."""
        return self.release(sys.maxsize)

    def __len__(self) -> int:
        return len(self._held)
