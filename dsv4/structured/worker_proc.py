"""The grammar worker process (docs/architecture.md, "Structured outputs"): it owns the
matchers (a `registry.Grammars`, keyed by the slot numbers the engine gives its constrained
requests) and does every per-step grammar call, so the engine's main thread only posts a step.

Commands come in order on one pipe (`Connection.send`, small pickled tuples); replies go back
on another, one per command that asks for one (`step`, `verify`, `ping`):

    ("add", slot, spec, background)           compile (cached by constraint), a new matcher; in the
                                              background: on the compile thread, which then
                                              posts ("compiled", slot, error | None) on the
                                              notice pipe (a cached one at once, from here)
    ("drop", slot)
    ("accept", slots, tokens)                 in order, one token at a time (no reply)
    ("step", pairs, row_slots, half)          accept the (slot, token) pairs (a slot at most
                                              once), then fill the mask of the rows `row_slots`
                                              (-1: unconstrained) into half `half` of the shared
                                              buffer -> ("mask", rows under a grammar | None
                                              when every row is, n)
    ("verify", [(slot | -1, drafts)])         -> ("verify", rows [R] int64, bitmask [R, W]) | None
    ("buffer", path, rows)                    the shared buffer, [2, rows, W] int32 (a file)
    ("ping",)                                 -> ("pong",)
    ("stop",)

The matchers of finished background compiles are made before each command is run: the engine
names a slot in a step only after its notice, sent once the result was queued here.

A command that raises is answered, at the next reply due, by ("error", text) in that reply's
place (the command asking for it still runs: the accepts of a step are state). The process
ends on "stop" or when the engine's end of the pipe closes (the engine gone)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection


def serve(commands: Connection, replies: Connection, notices: Connection, tokenizer_path: str, vocab_size: int,
          eos_token_id: int, fill_threads: int | None, in_thread: bool = False) -> None:
    """The process's entry (multiprocessing spawn). tokenizer_path: the tokenizer's JSON in a
    file this removes once read (a large argument would hold the engine's `start` until this
    process has started). Ends the process at once when done (nothing of its own to clean up:
    no interpreter teardown), unless `in_thread` (a benchmark's thread variant)."""
    if not in_thread:           # a terminal's Ctrl-C reaches every process: the engine decides (SIGTERM,
        signal.signal(signal.SIGINT, signal.SIG_IGN)     # multiprocessing's end of a daemon, still ends it)
        import torch
        torch.set_num_threads(1)        # (no intra-op pool: this process's tensors are a few rows)
    with open(tokenizer_path, encoding="utf-8") as f:
        tokenizer_json = f.read()
    os.unlink(tokenizer_path)
    Worker(commands, replies, tokenizer_json, vocab_size, eos_token_id, fill_threads, notices).loop()
    if not in_thread:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class Worker:
    def __init__(self, commands: Connection, replies: Connection, tokenizer_json: str, vocab_size: int,
                 eos_token_id: int, fill_threads: int | None, notices: Connection | None = None):
        from tokenizers import Tokenizer

        from .masks import MaskFiller
        from .registry import Grammars
        self.commands, self.replies, self.notices = commands, replies, notices
        self._notice_lock = threading.Lock()    # notices come from this loop (cached) and the compile thread
        self.grammars = Grammars(Tokenizer.from_str(tokenizer_json), vocab_size, eos_token_id)
        self.grammars.notify = self._notify         # (called on the compile thread)
        self.grammars.masks = MaskFiller(vocab_size, self.grammars.keep, threads=fill_threads or None)
        if fill_threads == 0:       # every fill inline, on this process's main thread
            self.grammars.masks.thread_min_rows = 1 << 30
        self.buffer = None          # [2, rows, W] int32 over the shared memory (`buffer`)
        self._map = None
        self.error: str | None = None   # of a command without a reply, told with the next reply

    def loop(self) -> None:
        while True:
            try:
                command = self.commands.recv()
            except (EOFError, OSError):     # the engine is gone
                return
            if command[0] == "stop":
                return
            try:
                self.grammars.compiled()        # the matchers of finished background compiles
                reply = getattr(self, "_" + command[0])(*command[1:])
            except Exception as e:  # noqa: BLE001 - told to the engine (which ends this process)
                traceback.print_exc()
                self.error = self.error or f"{type(e).__name__}: {e}"
                reply = ("error",) if command[0] in ("step", "verify", "ping") else None
            if reply is not None:
                if self.error is not None:
                    reply, self.error = ("error", self.error), None
                self.replies.send(reply)

    def _add(self, slot: int, spec, background: bool = False) -> None:
        # (checked by the engine's WorkerGrammars.add: not again on this loop, which answers the steps)
        if self.grammars.add(slot, spec, background, checked=True) is not None and background:
            self._notify(slot, None)        # (cached: ready now)

    def _notify(self, slot: int, error: str | None) -> None:
        try:
            with self._notice_lock:
                self.notices.send(("compiled", slot, error))
        except (OSError, ValueError):       # the engine is gone (the loop ends at its next receive)
            pass

    def _drop(self, slot: int) -> None:
        self.grammars.drop(slot)

    def _accept(self, slots: list[int], tokens: list[int]) -> None:
        self.grammars.accept([(self._grammar(s), t) for s, t in zip(slots, tokens)])

    def _step(self, taken: list[tuple[int, int]], row_slots: list[int], half: int) -> tuple:
        taken = [(self._grammar(s), t) for s, t in taken]
        masks = self.grammars.masks
        masks.buffer, masks.all_rows = self.buffer[half], self.all_rows    # filled in place (rows fit)
        pending = self.grammars.step_masks(row_slots, taken)
        if pending is None:
            return ("mask", [], 0)
        mask = pending.result()
        n = mask.bitmask.shape[0]
        if mask.bitmask.data_ptr() != self.buffer[half].data_ptr():
            self.buffer[half, :n].copy_(mask.bitmask)
        return ("mask", None if mask.covers_all else mask.rows.tolist(), n)

    def _verify(self, chunks: list[tuple[int, list[int]]]):
        mask = self.grammars.verify_masks(chunks)
        return ("verify", None if mask is None else (mask.rows.numpy(), mask.bitmask.numpy()))

    def _buffer(self, path: str, rows: int) -> None:
        """Map the engine's buffer file (/dev/shm; the engine unlinks it once this is done)."""
        import mmap

        import torch
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.buffer = torch.frombuffer(self._map, dtype=torch.int32).view(2, rows, -1)
        self.all_rows = torch.arange(rows)

    def _ping(self) -> tuple:
        return ("pong",)

    def _grammar(self, slot: int):
        grammar = self.grammars.get(slot)
        if grammar is None:
            raise KeyError(f"no grammar in slot {slot}")
        return grammar
