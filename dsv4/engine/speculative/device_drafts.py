"""Drafts that stay on the device until the step that verifies them (docs/speculative.md, "One step").

After a draft of plain greedy requests (decoder._plain_greedy: their drafts' values matter to
nothing but the verify forward's inputs and the acceptance test), the host does not wait for
the drafter: the request's `spec_token_ids` gets one placeholder (-1) a draft — the scheduler
needs only their count — and the values stay here, on the device. The next verify step
takes them from here twice, from the same rows of the same tensor: into the forward's token
rows (`fills`, applied by the runner like runner.PendingFill's pending tokens) and into the
ids the acceptance test compares against (`ids`, onto the verify rows). Both read the
same values, so a row is accepted only when the target's token is the input the next row was
computed with. A placeholder never reaches the model: a missing fill would feed token -1,
which the embedding refuses.

Invariant: every request here has `spec_token_ids` = [-1] * n with n <= its entry's count, and
is dropped when its drafts are verified, replaced or its request finishes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runner import PendingFill

PLACEHOLDER = -1


@dataclass
class HeldDrafts:
    request: object
    tokens: torch.Tensor            # [M] long on the device: the drafts of one draft step, flat
    first: int                      # this request's first draft in `tokens`
    count: int


class DeviceDrafts:
    def __init__(self):
        self.held: dict[str, HeldDrafts] = {}

    def hold(self, requests: list, drafts: list[torch.Tensor]) -> None:
        """The drafts [n] of each request (device tensors, one draft step's) stay here."""
        flat = torch.cat(drafts) if len(drafts) > 1 else drafts[0]
        first = 0
        for req, d in zip(requests, drafts):
            n = int(d.shape[0])
            req.spec_token_ids = [PLACEHOLDER] * n
            self.held[req.request_id] = HeldDrafts(req, flat, first, n)
            first += n

    def holds(self, req) -> bool:
        return req.request_id in self.held

    def drop(self, req) -> None:
        self.held.pop(req.request_id, None)

    def prune(self) -> None:
        """Forget the drafts of requests that finished."""
        self.held = {rid: h for rid, h in self.held.items() if not h.request.is_finished}

    def values(self, req) -> list[int]:
        """A request's drafts on the host (a read-back: for tests and debugging)."""
        h = self.held.get(req.request_id)
        if h is None:
            return list(req.spec_token_ids)
        return h.tokens[h.first:h.first + len(req.spec_token_ids)].tolist()

    def fills(self, targets: list[tuple[object, int, int]]) -> list[PendingFill]:
        """targets: (request, first row, n): rows first .. first + n - 1 of some tensor take the
        request's first n drafts. -> the fills that write them (one per draft step the drafts
        come from; none for requests whose drafts are on the host)."""
        return [PendingFill(torch.tensor(dst), torch.tensor(src), tokens)
                for tokens, dst, src in self._sources(targets)]

    def ids(self, host_ids: list[int], targets: list[tuple[object, int, int]], h2d) -> torch.Tensor:
        """host_ids (the drafts to check, -1 at rows whose drafts are here) on the device with
        `targets`' drafts written in (as `fills` writes them), in one upload."""
        sources = self._sources(targets)
        moved = h2d.upload([torch.tensor(host_ids)] + [torch.tensor(x) for _, dst, src in sources for x in (dst, src)])
        for g, (tokens, _, _) in enumerate(sources):
            moved[0][moved[1 + 2 * g]] = tokens[moved[2 + 2 * g]]
        return moved[0]

    def _sources(self, targets) -> list[tuple[torch.Tensor, list[int], list[int]]]:
        """(drafts tensor, rows to write, its rows to read) per draft step the targets' drafts come from."""
        by_tensor: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for req, row, n in targets:
            h = self.held.get(req.request_id)
            if h is None or n == 0:
                continue
            assert n <= h.count, (req.request_id, n, h.count)
            _, dst, src = by_tensor.setdefault(id(h.tokens), (h.tokens, [], []))
            dst += range(row, row + n)
            src += range(h.first, h.first + n)
        return list(by_tensor.values())
