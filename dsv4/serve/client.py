"""The API process's handle on the engine-core process.

`start()` spawns the engine core (its model is never loaded here), waits for `Ready` and
raises `EngineStartError` with the engine's reason when it cannot start. Then, inside the
event loop, `run()` starts one sender task and one receiver task; `submit()` sends the
requests of one HTTP request and returns a `RequestGroup` whose queue the receiver feeds;
`abort()` is safe from anywhere (also from a cancelled task's `finally`). When the engine
process dies, every open group gets an `EngineDead` item, `alive` turns False and
`on_death` is called (the server shuts down).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from ..sampling_params import SamplingParams
from ..engine.core import run_engine_core
from ..engine.ipc import (AbortRequests, AddRequest, Addresses, EngineStats, Ready, RequestFailed, ResetPrefixCache,
                  Shutdown, StartupFailed, StepOutputs, TokenOutput, api_sockets, decode_output, encode)

log = logging.getLogger("dsv4.serve")


class EngineStartError(RuntimeError):
    pass


class EngineDead:
    """Queue item: the engine core is gone."""


class RequestGroup:
    """The engine requests of one HTTP request (n choices x prompts), one shared queue of
    (child index, TokenOutput | RequestFailed | EngineDead)."""

    def __init__(self, client: "EngineClient", request_ids: list[str]):
        self.client, self.request_ids = client, request_ids
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.queue: asyncio.Queue = asyncio.Queue()
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
    def __init__(self, model_dir: str, config, target: Callable = run_engine_core):
        self.model_dir, self.config, self.target = model_dir, config, target
        self.addresses = Addresses.new()
        self.ctx = zmq.Context()
        self._push, self._pull = api_sockets(self.ctx, self.addresses)
        self.process: multiprocessing.Process | None = None
        self.info: Ready | None = None
        self.stats = EngineStats()
        self.groups: dict[str, RequestGroup] = {}
        self.on_death: Callable[[], None] | None = None
        self.on_stats: Callable[[EngineStats], None] | None = None
        self._outbox: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._dead = False

    # ---- startup (before the event loop) -----------------------------------------------
    def start(self, timeout: float | None = None) -> Ready:
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=self.target, name="dsv4-engine-core",
                                   args=(self.model_dir, self.config, self.addresses, os.getpid()))
        self.process.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pull.poll(100):
            if not self.process.is_alive():
                raise EngineStartError(f"the engine core exited with code {self.process.exitcode} "
                                       f"while loading {self.model_dir!r} (see its log above)")
            if deadline is not None and time.monotonic() > deadline:
                self.close(timeout=1)
                raise EngineStartError(f"the engine core did not get ready within {timeout:.0f} s")
        message = decode_output(self._pull.recv())
        if isinstance(message, StartupFailed):
            self.process.join(5)
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
        """A socket task that fails leaves no way to reach the engine: treat it as dead."""
        if not task.cancelled() and task.exception() is not None:
            log.error("lost the engine core's sockets", exc_info=task.exception())
            self._engine_died()

    @property
    def alive(self) -> bool:
        return not self._dead and self.process is not None and self.process.is_alive()

    def submit(self, prompts: list[list[int]], params: list[SamplingParams], base_id: str) -> RequestGroup:
        ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        group = RequestGroup(self, ids)
        if self._dead:
            for rid in ids:
                group.put(rid, EngineDead())
            return group
        for rid, prompt, p in zip(ids, prompts, params):
            self.groups[rid] = group
            self._outbox.put_nowait(AddRequest(rid, prompt, p))
        return group

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.groups.pop(rid, None)
        if request_ids and not self._dead and self._outbox is not None:
            self._outbox.put_nowait(AbortRequests(list(request_ids)))

    def reset_prefix_cache(self) -> None:
        """Ask the engine to forget its cached prefixes (before any request sent after this)."""
        if not self._dead and self._outbox is not None:
            self._outbox.put_nowait(ResetPrefixCache())

    async def _send_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            message = await self._outbox.get()
            await sock.send(encode(message))

    async def _receive_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            message = decode_output(await sock.recv())
            if isinstance(message, StepOutputs):
                self._dispatch(message)

    def _dispatch(self, message: StepOutputs) -> None:
        items: list[tuple[str, TokenOutput | RequestFailed]] = [(o.request_id, o) for o in message.outputs]
        items += [(f.request_id, f) for f in message.failures]
        for rid, item in items:
            group = self.groups.get(rid)
            if group is None:
                continue   # aborted meanwhile
            group.put(rid, item)
            if isinstance(item, RequestFailed) or item.finished:
                self.groups.pop(rid, None)
        self.stats = message.stats
        if self.on_stats is not None:
            self.on_stats(message.stats)

    def _engine_died(self) -> None:
        if self._dead:
            return
        self._dead = True
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        log.error("the engine core is gone (exit code %s); failing %d request(s) in flight",
                  self.process.exitcode, len(self.groups))
        for rid, group in list(self.groups.items()):
            group.put(rid, EngineDead())
        self.groups.clear()
        if self.on_death is not None:
            self.on_death()

    # ---- shutdown ----------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        for task in self._tasks:
            task.cancel()
        if self.process is not None and self.process.is_alive():
            try:
                self._push.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(timeout)
        self.ctx.destroy(linger=0)
        self.addresses.remove()
