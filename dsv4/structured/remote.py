"""The engine's grammars in a worker process (docs/architecture.md, "Structured outputs"): the
same calls as `registry.Grammars`, but the matchers live in `worker_proc.py`'s process and a
step's grammar work is one message to it. The main thread posts the step (the previous step's
(slot, token) pairs and the next step's row slots: a few µs), goes on with the step's host work
while the worker accepts and fills the rows into a shared buffer, and reads the reply (rows,
count; usually waiting already) right before the upload.

A request's handle (`get`) is its slot number in the worker. A constraint is checked here
(`grammars.build_checked`, tokenizer-free, once per constraint: an LRU of keys) so `add` still raises
for a bad one; the worker compiles it against the vocabulary. With `add(background=True)` (the
engine's) the worker compiles it on its compile thread, a constraint over
`grammars.CHECK_AT_ADD_CHARS` checked there too, and posts a notice on a third pipe when done;
`compiled()` reads the notices between steps (the request is not scheduled before its one). The shared buffer is
[2, rows, W] int32 in a /dev/shm file (unlinked once the worker has mapped it), a half per
step in turn, so a mask read for step k is not overwritten by step k+1's fill.

The worker's death (any failed send or receive) or failure (an error reply: the worker is
ended, its matchers may be half-way through a step) is kept in `error`: from then on masks are
None and posts do nothing, and the engine fails the constrained requests with that error
(`LLMEngine._complete`); once they are gone, the next `add` starts a fresh worker. `close`
stops it; the worker also ends when the engine's pipe closes (the engine gone), and is a
daemon of the engine's process."""
from __future__ import annotations

import mmap
import multiprocessing
import os
import select
import tempfile
import threading
import time

import torch

from ..sampling_params import StructuredOutputs
from .compiler import CACHE_ENTRIES
from .grammars import CHECK_AT_ADD_CHARS, CheckedSpecs, GrammarError, spec_chars
from .masks import GrammarMask, words
from .registry import only_token, special_token_filter

_UNREAD = object()
# How long a reply, or a background compile's notice, may take before the worker counts as hung
# (killed, its requests failed): a sync `add`'s compile holds the replies after it (large
# schemas: seconds).
REPLY_TIMEOUT_S = 60.0


class GrammarWorkerError(RuntimeError):
    """The grammar worker process failed or exited."""


class WorkerGrammars:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int, rows: int, fill_threads: int | None = None,
                 in_thread: bool = False, page_lock: bool = False):
        """rows: the sampling rows of a step the buffer holds at first (grown when a step has
        more); fill_threads: the worker's fill threads (None: masks.FILL_THREADS; 0: none, its
        fills inline); in_thread: the worker's loop on a thread of this process instead
        (benchmarks/structured_output.py compares the two: the thread shares this GIL);
        page_lock: register the buffer with CUDA (a GPU engine), so a step's mask crosses to the
        device in one asynchronous copy straight from it, with no packing."""
        self.in_thread, self.page_lock = in_thread, page_lock and torch.cuda.is_available()
        self._locked: int | None = None           # the buffer's address while registered with CUDA
        if tokenizer is None:
            raise ValueError("structured outputs need the checkpoint's tokenizer (tokenizer.json)")
        hf = tokenizer._hf if hasattr(tokenizer, "_hf") else tokenizer
        self._tokenizer_json = hf.to_str()
        self._worker_args = (vocab_size, eos_token_id, fill_threads, in_thread)
        self.vocab_size, self.width = vocab_size, words(vocab_size)
        self.keep = special_token_filter(tokenizer, vocab_size)
        self.end_row = only_token(eos_token_id, vocab_size)
        self._slots: dict[str, int] = {}          # request id -> its slot in the worker
        self._next_slot = 0
        self._checks = CheckedSpecs(CACHE_ENTRIES)
        self._compiling: dict[int, tuple[str, float]] = {}    # slot -> (request id, when added), compiling
        self._rows = rows
        self._last_ids, self._last_slots = None, []    # the last step's rows and their slots (until an add or drop)
        self.error: str | None = None             # why the worker is gone (None: running)
        self.pending: PendingRemote | None = None  # the step mask posted and not read yet
        self._start()

    # ---- the process -------------------------------------------------------------------
    def _start(self) -> None:
        from . import worker_proc
        ctx = multiprocessing.get_context("spawn")
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._replies, replies_out = ctx.Pipe(duplex=False)
        self._notices, notices_out = ctx.Pipe(duplex=False)     # ("compiled", slot, error), from its compile thread
        start = _WorkerThread if self.in_thread else ctx.Process
        fd, self._tokenizer_file = tempfile.mkstemp(prefix="dsv4-grammar-tokenizer-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(self._tokenizer_json)       # (the worker removes it once read)
        self.process = start(target=worker_proc.serve, name="dsv4-grammar-worker", daemon=True,
                             args=(commands_in, replies_out, notices_out, self._tokenizer_file, *self._worker_args))
        self.process.start()
        self._ready = select.poll()             # (Connection.poll builds a selector a call: ~10 µs)
        self._ready.register(self._replies.fileno(), select.POLLIN)
        self._noticed = select.poll()
        self._noticed.register(self._notices.fileno(), select.POLLIN)
        if not self.in_thread:
            commands_in.close()         # (only the worker holds these ends: its death is an EOF here)
            replies_out.close()
            notices_out.close()
        self._compiling = {}
        self.error, self.pending, self._half = None, None, 0
        self._unlink: list[str] = []     # buffer files the worker may not have mapped yet
        self._map_buffer(self._rows)

    def _map_buffer(self, rows: int) -> None:
        self._unlock()
        fd, path = tempfile.mkstemp(prefix="dsv4-grammar-masks-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            os.ftruncate(fd, 2 * rows * self.width * 4)
            self._map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._map, dtype=torch.int32).view(2, rows, self.width)
        self.views: dict[tuple[int, int], torch.Tensor] = {}    # buffer[half, :n] by (half, n <= rows)
        self.all_rows = torch.arange(rows)
        self._rows = rows
        self._unlink.append(path)
        self._send(("buffer", path, rows))
        if self.page_lock:
            cudart = torch.cuda.cudart()
            if cudart.cudaHostRegister(self.buffer.data_ptr(), self.buffer.nbytes, 0) == cudart.cudaError.success:
                self._locked = self.buffer.data_ptr()       # (else the masks take the packed upload)

    def _unlock(self) -> None:
        """Unregister the buffer (before it is unmapped), once the copies from it are done.
        A step's mask is read by the copy the step's sampling queued: the step after next (when
        the worker refills that half) comes after that copy on the stream, so only a regrow or
        a close needs this wait."""
        if self._locked is not None:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._locked)
            self._locked = None

    def _remove_files(self) -> None:
        """Unlink the buffer files sent: the worker has mapped them once it replies after."""
        while self._unlink:
            _remove(self._unlink.pop())

    def _send(self, command: tuple) -> bool:
        if self.error is not None:
            return False
        try:
            self._commands.send(command)
            return True
        except (OSError, ValueError) as e:
            self._died(e)
            return False

    def _reply(self):
        """The next reply, or None once the worker is gone."""
        if self.error is not None:
            return None
        try:
            if not self._ready.poll(REPLY_TIMEOUT_S * 1000):    # (a hang-up, the worker gone, counts)
                self.process.kill()
                self._died(None, f"the grammar worker process did not answer within {REPLY_TIMEOUT_S:g} s "
                                 f"(killed)")
                return None
            reply = self._replies.recv()
        except (EOFError, OSError) as e:
            self._died(e)
            return None
        self._remove_files()
        if reply[0] == "error":         # its matchers may be half-way through a step: ended here
            self.process.kill()
            self._died(None, f"the grammar worker failed: {reply[1] if len(reply) > 1 else '?'}")
            return None
        return reply

    def _died(self, cause: BaseException | None, why: str | None = None) -> None:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        self.error = why or (f"the grammar worker process exited (code {code})" if code is not None
                             else f"the grammar worker process stopped answering ({type(cause).__name__})")
        self.pending = None
        self._remove_files()

    def close(self) -> None:
        self._send(("stop",))
        self.process.join(timeout=5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._remove_files()
        self._unlock()
        _remove(self._tokenizer_file)       # (a worker that died before reading it)
        if self.error is None:
            self.error = "closed"

    # ---- requests ----------------------------------------------------------------------
    def add(self, request_id: str, spec: StructuredOutputs, background: bool = False) -> int | None:
        """The request's slot; None while it compiles in the background (until `compiled()`
        names it). Raises grammars.GrammarError (a ValueError naming the problem) for a bad
        constraint (in the background: one over CHECK_AT_ADD_CHARS fails from `compiled()`),
        GrammarWorkerError while constrained requests of a dead worker remain."""
        if not background or spec_chars(spec) <= CHECK_AT_ADD_CHARS:
            self._checks.check(spec)
        if self.error is not None:
            if self._slots:
                raise GrammarWorkerError(self.error)
            self._start()
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        self._send(("add", slot, spec, background))
        self._slots[request_id] = slot
        self._last_ids = None
        if background:
            self._compiling[slot] = (request_id, time.monotonic())
            return None
        return slot

    def compiled(self) -> list[tuple[str, GrammarError | None]]:
        """The background compiles the worker has finished since the last call (never waits):
        (request id, None) or (request id, its GrammarError); dropped requests left out. The
        worker's death is kept in `error` (the engine fails the requests then)."""
        done = []
        while self._compiling and self.error is None and self._noticed.poll(0):
            try:
                _, slot, error = self._notices.recv()
            except (EOFError, OSError) as e:
                self._died(e)
                break
            request_id, _ = self._compiling.pop(slot, (None, 0.0))
            if request_id is not None:
                done.append((request_id, None if error is None else GrammarError(error)))
        if self._compiling and self.error is None:      # (dicts keep insertion order: the oldest first)
            if time.monotonic() - next(iter(self._compiling.values()))[1] > REPLY_TIMEOUT_S:
                self.process.kill()
                self._died(None, f"the grammar worker process did not answer within {REPLY_TIMEOUT_S:g} s "
                                 f"(killed)")
        return done

    def wait_compiled(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a notice (or the worker's death)."""
        if self._compiling and self.error is None:
            self._noticed.poll(timeout * 1000)      # (a hang-up, the worker gone, counts)

    def get(self, request_id: str) -> int | None:
        return self._slots.get(request_id)

    def drop(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        self._last_ids = None
        if slot is not None:
            self._compiling.pop(slot, None)
            self._send(("drop", slot))

    def __len__(self) -> int:
        return len(self._slots)

    # ---- steps -------------------------------------------------------------------------
    def idle(self) -> None:
        """Read a step mask posted and never read (its step failed), so replies stay in order."""
        if self.pending is not None:
            self.pending.result()

    def step_masks(self, request_ids: list[str], taken: list[tuple[int, int]] = ()) -> PendingRemote | None:
        """As registry.Grammars.step_masks, `taken` by slot: posted to the worker, which
        accepts `taken` and fills the rows' mask meanwhile. None when no row has a grammar."""
        self.idle()
        if request_ids != self._last_ids:       # (the same rows step after step: one C compare)
            self._last_ids, self._last_slots = request_ids, [self._slots.get(rid, -1) for rid in request_ids]
        row_slots = self._last_slots
        if len(row_slots) > self._rows:
            self._map_buffer(max(len(row_slots), 2 * self._rows))
        if max(row_slots, default=-1) < 0:
            self.accept(taken)
            return None
        self._half ^= 1
        if not self._send(("step", taken, row_slots, self._half)):
            return PendingRemote(self, self._half, len(row_slots), done=True)
        self.pending = PendingRemote(self, self._half, len(row_slots))
        return self.pending

    def accept(self, taken: list[tuple[int, int]]) -> None:
        """The (slot, token) pairs, in order, one token at a time, with no mask after."""
        self.idle()
        if taken:
            self._send(("accept", [s for s, _ in taken], [t for _, t in taken]))

    def verify_masks(self, chunks: list[tuple[str, list[int]]]) -> GrammarMask | None:
        """As registry.Grammars.verify_masks, filled by the worker while this waits."""
        self.idle()
        if not self._send(("verify", [(self._slots.get(rid, -1), d) for rid, d in chunks])):
            return None
        reply = self._reply()
        if reply is None or reply[1] is None:
            return None
        rows, bitmask = reply[1]
        return GrammarMask(torch.from_numpy(rows), torch.from_numpy(bitmask), keep=self.keep)

    def ping(self) -> bool:
        """Whether the worker answers (every command before it done)."""
        self.idle()
        return self._send(("ping",)) and self._reply() is not None


class PendingRemote:
    """A step's mask being filled by the worker: `result()` waits for its reply."""

    def __init__(self, owner: WorkerGrammars, half: int, num_rows: int, done: bool = False):
        self.owner, self.half, self.num_rows = owner, half, num_rows
        self.mask = None if done else _UNREAD

    def result(self) -> GrammarMask | None:
        """The mask (a view of the shared buffer, valid until the step after next is posted),
        or None: no row constrained, or the worker is gone (`owner.error`)."""
        if self.mask is not _UNREAD:
            return self.mask
        owner = self.owner
        if owner.pending is self:
            owner.pending = None
        self.mask = None
        reply = owner._reply()
        if reply is None or reply[2] == 0:
            return None
        rows, n = reply[1], reply[2]
        rows_t = owner.all_rows[:n] if rows is None else torch.tensor(rows, dtype=torch.long)
        bitmask = owner.views.get((self.half, n))
        if bitmask is None:
            bitmask = owner.views[(self.half, n)] = owner.buffer[self.half, :n]
        self.mask = GrammarMask(rows_t, bitmask, rows is None, owner.keep, page_locked=owner._locked is not None)
        return self.mask


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _WorkerThread(threading.Thread):
    """The worker's loop on a thread, with a process's `kill` / `exitcode` (a benchmark variant)."""

    def kill(self) -> None:
        self._args[0].close()           # (its command pipe: the loop ends at its next receive)

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive() else 0
