"""One request's grammar state: an xgrammar matcher, gated by `</think>` in thinking mode.

Before the gate opens (`after_think` and `</think>` not generated yet) the request is free:
no mask. Every generated token is `accept`ed in order (or, a decode step's rows at once, through
`take_gate` on the engine's thread, then xgrammar batch calls on the fill threads, and `took`
for a stop token: structured/masks.owed_tokens); a token the
grammar refuses (only possible while the mask was not applied, e.g. a surplus row) leaves the
state as it was."""
from __future__ import annotations


class RequestGrammar:
    def __init__(self, compiled, think_end_id: int | None, after_think: bool, end_row, stop_id: int):
        """end_row: [ceil(V / 32)] int32, EOS's bit alone: the mask once the grammar has ended
        (xgrammar refuses to fill a terminated matcher). stop_id: the grammar's only stop token
        (EOS; structured/compiler.py): the matcher can end only by accepting it. The special
        tokens no grammar may produce are cleared by the sampler (engine/sampler.py)."""
        import xgrammar
        self.matcher = xgrammar.GrammarMatcher(compiled, max_rollback_tokens=-1)
        self.end_row, self.stop_id = end_row, stop_id
        self.think_end_id = think_end_id
        self.open = not after_think or think_end_id is None
        self.ended = False          # == matcher.is_terminated(), kept without a call per step

    @property
    def constrains(self) -> bool:
        """Whether the next token is masked."""
        return self.open

    @property
    def finished(self) -> bool:
        return self.open and self.ended

    def accept(self, token: int) -> bool:
        if not self.take_gate(token):
            return True
        ok = self.matcher.accept_token(token)
        self.took(token)
        return ok

    def take_gate(self, token: int) -> bool:
        """Whether `token` is the matcher's to accept (then `accept_token` and `took` follow); if
        not, the gate has taken it (a token before `</think>`, or the EOS that ended the grammar,
        seen again)."""
        if not self.open:
            self.open = token == self.think_end_id
            return False
        return not self.ended

    def took(self, token: int) -> None:
        """After the matcher was given `token` (accepted or not)."""
        if token == self.stop_id:
            self.ended = self.matcher.is_terminated()

    def fill(self, bitmask, row: int) -> None:
        """Row `row` of the int32 bitmask [R, ceil(V/32)] <- the tokens allowed next (EOS
        alone once the grammar has ended, e.g. under ignore_eos)."""
        _fill_row(self.matcher, self.ended, self.end_row, bitmask, row)

    def fill_drafts(self, bitmask, first_row: int, drafts: list[int]) -> list[bool]:
        """Rows first_row .. first_row + len(drafts) <- the masks after drafts[:j], j = 0..len;
        the state is rolled back after. -> per row whether it is masked (rows past a draft the
        grammar refuses, and rows before the gate opens, are left free)."""
        masked, accepted, was_open = [], 0, self.open
        for j in range(len(drafts) + 1):
            if self.open:
                _fill_row(self.matcher, self.matcher.is_terminated(), self.end_row, bitmask, first_row + j)
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


def _fill_row(matcher, terminated: bool, end_row, bitmask, row: int) -> None:
    if terminated:
        bitmask[row] = end_row
    else:
        matcher.fill_next_token_bitmask(bitmask, row)
