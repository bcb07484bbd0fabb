"""One request's grammar state: an xgrammar matcher, gated by `</think>` in thinking mode.

Before the gate opens (`after_think` and `</think>` not generated yet) the request is free:
no mask. Every generated token is `accept`ed in order; a token the grammar refuses (only
possible while the mask was not applied, e.g. a surplus row) is recorded in `errors` and
leaves the state as it was."""
from __future__ import annotations


class RequestGrammar:
    def __init__(self, compiled, think_end_id: int | None, after_think: bool, end_row):
        """end_row: [ceil(V / 32)] int32, EOS's bit alone: the mask once the grammar has ended
        (xgrammar refuses to fill a terminated matcher). The special tokens no grammar may
        produce are cleared by structured/masks.py, once per mask."""
        import xgrammar
        self.matcher = xgrammar.GrammarMatcher(compiled, max_rollback_tokens=-1)
        self.end_row = end_row
        self.think_end_id = think_end_id
        self.open = not after_think or think_end_id is None
        self.errors = 0

    @property
    def constrains(self) -> bool:
        """Whether the next token is masked."""
        return self.open

    @property
    def finished(self) -> bool:
        return self.open and self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        if not self.open:
            self.open = token == self.think_end_id
            return True
        if self.matcher.is_terminated():
            return True                      # the EOS that ended it, seen again: nothing to do
        ok = self.matcher.accept_token(token)
        self.errors += not ok
        return ok

    def fill(self, bitmask, row: int) -> None:
        """Row `row` of the int32 bitmask [R, ceil(V/32)] <- the tokens allowed next (EOS
        alone once the grammar has ended, e.g. under ignore_eos)."""
        if self.matcher.is_terminated():
            bitmask[row] = self.end_row
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_drafts(self, bitmask, first_row: int, drafts: list[int]) -> list[bool]:
        """Rows first_row .. first_row + len(drafts) <- the masks after drafts[:j], j = 0..len;
        the state is rolled back after. -> per row whether it is masked (rows past a draft the
        grammar refuses, and rows before the gate opens, are left free)."""
        masked, accepted, was_open = [], 0, self.open
        for j in range(len(drafts) + 1):
            if self.open:
                self.fill(bitmask, first_row + j)
            masked.append(self.open)
            if j == len(drafts):
                break
            if not self.open:
                self.open = drafts[j] == self.think_end_id
            elif self.matcher.is_terminated() or not self.matcher.accept_token(drafts[j]):
                masked += [False] * (len(drafts) - j)      # rows past a refused draft: never emitted
                break
            else:
                accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        self.open = was_open
        return masked
