"""The queue of one HTTP request's engine items (`RequestGroup.queue`, serve/client.py): the
part of `asyncio.Queue` a stream uses, for one consumer, at a fraction of its cost per item.

The receive task puts every output of every stream each engine step (docs/architecture.md,
"Serving"); `asyncio.Queue` spends several Python calls per item on bounds, task counting and
its waiter queues, none of which one unbounded queue with one reader needs. Event-loop thread
only, like `asyncio.Queue`.
"""
from __future__ import annotations

import asyncio
from collections import deque


class ItemQueue:
    def __init__(self):
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None   # the reader's, while it waits in `get`

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def get_nowait(self):
        """The oldest item; asyncio.QueueEmpty when there is none."""
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self):
        """The oldest item, waiting for one. One reader at a time (a second is an error)."""
        while not self._items:
            if self._waiter is not None:
                raise RuntimeError("ItemQueue has one reader")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()
