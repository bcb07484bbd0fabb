"""The API process's handle on the engine-core process.

`start()` spawns the engine core (its model is never loaded here), waits for `Ready` and
raises `EngineStartError` with the engine's reason when it cannot start. Then, inside the
event loop, `run()` starts one sender task and one receiver task; `submit()` sends the
requests of one HTTP request and returns a `RequestGroup` whose queue the receiver feeds;
`abort()` is safe from anywhere (also from a cancelled task's `finally`). When the engine
process dies (or its sockets fail, or it sends a frame that cannot be decoded), every open
group gets an `EngineDead` item saying which, `alive` turns False and `on_death` is called
(the server shuts down).

Failure rules: `submit` encodes every request before queueing any, so a request the wire
cannot carry fails alone (`NotEncodable`, a 400) and never reaches the send task; the send
task fails the one request whose frame it could not send and goes on. At shutdown
`fail_all` ends every open group with a 503 and refuses new submissions.

With several API processes (`--api-server-count`, serve/http/api_workers.py) each has its own
client and pipes: process 0's spawns the engine core, the others `attach` to it (they watch
its pid: engine_process.py) and never stop it; request ids carry the process index
(`ipc.owned_id`), so the engine core sends each process its own outputs.

Stop strings are checked here (`tokenizer` set: the server's), not in the engine: a request
with stop strings gets a `StopStringWatch` (text/stop_watch.py); the output whose tokens
complete a stop string is cut there and delivered as the request's last (finish_reason "stop",
the string as stop_reason, the cut text as final_text) and the engine is told to abort it.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from ..sampling_params import SamplingParams
from ..text.stop_watch import StopStringWatch
from .engine_process import EngineProcess
from .item_queue import ItemQueue
from ..engine.core import run_engine_core
from ..engine.ipc import (AbortRequests, AddRequest, Addresses, ImageItem, EngineStats, Ready, RequestFailed, ResetPrefixCache,
                  Shutdown, StartupFailed, StepOutputs, TokenOutput, api_sockets, decode_output, encode,
                  owned_id)

log = logging.getLogger("dsv4.serve")


def _encode_request(message: AddRequest) -> bytes:
    try:
        return encode(message)
    except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as e:
        raise NotEncodable(f"the request cannot be sent to the engine: {e}") from None


class EngineStartError(RuntimeError):
    pass


class NotEncodable(ValueError):
    """A request the engine wire (msgpack) cannot carry."""


class EngineDead:
    """Queue item: the engine core is gone (`message` says how)."""

    def __init__(self, message: str = "the engine core died; the server is shutting down"):
        self.message = message


class RequestGroup:
    """The engine requests of one HTTP request (n choices x prompts), one shared queue of
    (child index, TokenOutput | RequestFailed | EngineDead)."""

    def __init__(self, client: "EngineClient", request_ids: list[str]):
        self.client, self.request_ids = client, request_ids
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.queue = ItemQueue()        # (one reader: the handler of the HTTP request)
        self.unfinished = set(request_ids)
        self.peeked: tuple | None = None      # an item taken early (see streaming.first_output)
        self.cached_tokens = [0] * len(request_ids)   # per child: prompt tokens resumed from the prefix cache

    def put(self, rid: str, item) -> None:
        if isinstance(item, (RequestFailed, EngineDead)) or item.finished:
            self.unfinished.discard(rid)
        if isinstance(item, TokenOutput) and item.num_cached_tokens is not None and rid in self.index:
            self.cached_tokens[self.index[rid]] = item.num_cached_tokens
        self.queue.put_nowait((self.index.get(rid, 0), item))

    def abort(self) -> None:
        """Abort the children still running (no-op once all finished)."""
        if self.unfinished:
            self.client.abort(sorted(self.unfinished))
            self.unfinished.clear()


class EngineClient:
    """API process `index` of `count` (`--api-server-count`): process 0 spawns the engine core
    (`start`); the others attach to it (`attach`: its pid; the engine core then is not theirs
    to stop). Each binds its own pair of pipes (`Addresses.of(index)`)."""

    def __init__(self, model_dir: str, config, target: Callable = run_engine_core, count: int = 1,
                 addresses: Addresses | None = None, index: int = 0):
        self.model_dir, self.config, self.target = model_dir, config, target
        self.index, self.count = index, count
        self.addresses = addresses or Addresses.new(count)
        self.ctx = zmq.Context()
        self._push, self._pull = api_sockets(self.ctx, self.addresses.of(index))
        self.process: multiprocessing.Process | EngineProcess | None = None
        self.owns_engine = index == 0
        self.info: Ready | None = None
        self.stats = EngineStats()
        self.groups: dict[str, RequestGroup] = {}
        self.tokenizer = None                   # set by the server: stop strings are checked here
        self.watches: dict[str, StopStringWatch] = {}    # request id -> its stop-string watch
        self.on_death: Callable[[str], None] | None = None      # called with the reason
        self.on_stats: Callable[[EngineStats], None] | None = None
        self._outbox: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._dead = False
        self._closing: str | None = None       # set by fail_all: why new requests are refused

    # ---- startup (before the event loop) -----------------------------------------------
    def start(self, timeout: float | None = None, spawned: Callable[[int], None] | None = None) -> Ready:
        """Spawn the engine core and wait for its Ready; on failure everything is closed
        (the process, the sockets, the IPC folder) and EngineStartError says why.
        `spawned(pid)` runs once the engine core is started, before its Ready."""
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=self.target, name="dsv4-engine-core",
                                   args=(self.model_dir, self.config, self.addresses, os.getpid()))
        self.process.start()
        if spawned is not None:
            spawned(self.process.pid)
        return self._wait_ready(timeout)

    def attach(self, engine_pid: int, timeout: float | None = None) -> Ready:
        """An API process other than the first: wait for the Ready of the engine core `engine_pid`
        (started by the first); EngineStartError when it fails or exits first."""
        try:
            self.process = EngineProcess(engine_pid)
        except ProcessLookupError:
            self.close()
            raise EngineStartError("the engine core exited before this API process started") from None
        return self._wait_ready(timeout)

    def _wait_ready(self, timeout: float | None) -> Ready:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pull.poll(100):
            if not self.process.is_alive():
                self.close()
                raise EngineStartError(f"the engine core exited with code {self.process.exitcode} "
                                       f"while loading {self.model_dir!r} (see its log above)")
            if deadline is not None and time.monotonic() > deadline:
                self.close(timeout=1)
                raise EngineStartError(f"the engine core did not get ready within {timeout:.0f} s")
        message = decode_output(self._pull.recv())
        if isinstance(message, StartupFailed):
            if self.owns_engine:
                self.process.join(5)
            self.close()
            raise EngineStartError(message.message)
        self.info = message
        return message

    # ---- inside the event loop -------------------------------------------------------------
    def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._outbox = asyncio.Queue()
        push, pull = (zmq.asyncio.Socket.from_socket(s) for s in (self._push, self._pull))
        self._tasks = [loop.create_task(self._send_loop(push)), loop.create_task(self._receive_loop(pull))]
        for task in self._tasks:
            task.add_done_callback(self._task_done)
        loop.add_reader(self.process.sentinel, self._engine_died)

    def _task_done(self, task: asyncio.Task) -> None:
        """A socket task that fails leaves no way to reach the engine: shut down."""
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            log.error("lost the engine core's sockets", exc_info=error)
            what = ("the engine core sent a message that cannot be decoded" if isinstance(error, msgspec.DecodeError)
                    else f"lost the connection to the engine core ({type(error).__name__})")
            self._engine_died(f"{what}; the server is shutting down")

    @property
    def alive(self) -> bool:
        return not self._dead and self.process is not None and self.process.is_alive()

    def submit(self, prompts: list[list[int]], params: list[SamplingParams], base_id: str,
               images: list[ImageItem] | None = None, kv_transfer: str | None = None) -> RequestGroup:
        """Queue one engine request per prompt (each with `images`, the image blocks of a chat
        prompt); raises NotEncodable (nothing queued) when one of them cannot be encoded.
        `kv_transfer`: a decode engine pulls the prompts' state from that prefill engine
        (dsv4/disagg/)."""
        ids = [owned_id(self.index, self.count, f"{base_id}-{i}") for i in range(len(prompts))]
        frames = [_encode_request(AddRequest(rid, prompt, p, list(images or []), kv_transfer))
                  for rid, prompt, p in zip(ids, prompts, params)]
        group = RequestGroup(self, ids)
        if self._dead or self._closing:
            for rid in ids:
                group.put(rid, EngineDead() if self._dead else RequestFailed(rid, 503, self._closing))
            return group
        for rid, frame, prompt, p in zip(ids, frames, prompts, params):
            self.groups[rid] = group
            if p.stop and self.tokenizer is not None:
                self.watches[rid] = StopStringWatch(self.tokenizer, prompt, p)
            self._outbox.put_nowait((rid, frame))
        return group

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.groups.pop(rid, None)
            self.watches.pop(rid, None)
        if request_ids and not self._dead and self._outbox is not None:
            self._outbox.put_nowait((None, encode(AbortRequests(list(request_ids)))))

    def fail_all(self, message: str = "the server is shutting down") -> None:
        """End every open group with a 503 (their engine requests are aborted) and refuse
        new submissions from now on."""
        self._closing = message
        open_ids = list(self.groups)
        for rid in open_ids:
            self.groups[rid].put(rid, RequestFailed(rid, 503, message))
        self.abort(open_ids)

    def reset_prefix_cache(self) -> None:
        """Ask the engine to forget its cached prefixes (before any request sent after this)."""
        if not self._dead and self._outbox is not None:
            self._outbox.put_nowait((None, encode(ResetPrefixCache())))

    async def _send_loop(self, sock: zmq.asyncio.Socket) -> None:
        """Frames are encoded already; a socket error ends the loop (`_task_done`), any
        other failure to send fails that frame's request alone."""
        while True:
            rid, frame = await self._outbox.get()
            try:
                await sock.send(frame)
            except (zmq.ZMQError, asyncio.CancelledError):
                raise
            except Exception as e:  # noqa: BLE001 - one frame, one request
                log.exception("could not send a message to the engine core")
                group = self.groups.pop(rid, None) if rid is not None else None
                if group is not None:
                    group.put(rid, RequestFailed(rid, 500, f"could not send the request to the engine: {e}"))

    async def _receive_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            message = decode_output(await sock.recv())
            if isinstance(message, StepOutputs):
                self._dispatch(message)

    def _dispatch(self, message: StepOutputs) -> None:
        items: list[tuple[str, TokenOutput | RequestFailed]] = [(o.request_id, o) for o in message.outputs]
        items += [(f.request_id, f) for f in message.failures]
        stopped = []
        for rid, item in items:
            group = self.groups.get(rid)
            if group is None:
                continue   # aborted meanwhile
            if rid in self.watches and isinstance(item, TokenOutput):
                item = self._watch(rid, item)
                if item.finished and item.final_text is not None:
                    stopped.append(rid)
            group.put(rid, item)
            if isinstance(item, RequestFailed) or item.finished:
                self.groups.pop(rid, None)
                self.watches.pop(rid, None)
        if stopped:       # the engine goes on with them until it reads this
            self.abort(stopped)
        self.stats = message.stats
        if self.on_stats is not None:
            self.on_stats(message.stats)

    def _watch(self, rid: str, item: TokenOutput) -> TokenOutput:
        """`item`, cut after the token that completes a stop string (then the request's last)."""
        ended = item.finished and item.finish_reason == "stop"      # by its last token (EOS, a stop id)
        hit = self.watches[rid].push(item.token_ids[:-1] if ended else item.token_ids)
        if hit is None:
            return item
        keep, stop, text = hit
        return msgspec.structs.replace(
            item, token_ids=item.token_ids[:keep], finished=True, finish_reason="stop", stop_reason=stop,
            final_text=text, logprobs=item.logprobs[:keep] if item.logprobs is not None else None)

    def lose(self, message: str) -> None:
        """Treat the engine core as gone, for `message` (another API process died: it is killed
        next, serve/http/api_workers.py): every open group fails and the server stops."""
        self._engine_died(message)

    def _engine_died(self, message: str | None = None) -> None:
        if self._dead:
            return
        self._dead = True
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        log.error("%s (engine core exit code %s); failing %d request(s) in flight",
                  message or "the engine core is gone", self.process.exitcode, len(self.groups))
        for rid, group in list(self.groups.items()):
            group.put(rid, EngineDead(message) if message else EngineDead())
        self.groups.clear()
        if self.on_death is not None:
            self.on_death(message or f"the engine core died (exit code {self.process.exitcode})")

    # ---- shutdown ----------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        for task in self._tasks:
            task.cancel()
        if not self.owns_engine:        # the first API process stops the engine core and removes the folder
            if self.process is not None:
                self.process.close()
            self.ctx.destroy(linger=0)
            return
        if self.process is not None and self.process.is_alive():
            try:
                self._push.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(timeout if self.info is not None else 0)   # still loading: no waiting
            if self.process.is_alive():
                self.process.kill()     # the engine core ignores SIGTERM and SIGINT (ours to handle)
                self.process.join(timeout)
        self.ctx.destroy(linger=0)
        self.addresses.remove()
