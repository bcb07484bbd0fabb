"""Counters of speculative decoding, named like vLLM's spec-decode metrics: drafts (verify
steps of one request with at least one draft), drafted and accepted tokens, and accepted
tokens per draft position. Mean acceptance length = 1 + accepted / drafts: the tokens one
verify step emits per request (the bonus or correction token included)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # [k]: drafts accepted at position j

    def record(self, drafted: int, accepted: int) -> None:
        """One request's verify: `drafted` drafts checked, the first `accepted` of them kept."""
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [n / self.num_drafts for n in self.accepted_per_pos] if self.num_drafts else []

    def summary(self) -> dict:
        return {"spec_num_drafts": self.num_drafts, "spec_draft_tokens": self.num_draft_tokens,
                "spec_accepted_tokens": self.num_accepted_tokens,
                "spec_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
                if self.num_draft_tokens else 0.0,
                "spec_mean_acceptance_length": self.mean_acceptance_length,
                "spec_acceptance_rate_per_pos": [round(r, 4) for r in self.acceptance_rate_per_pos]}
